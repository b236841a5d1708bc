"""Two recipe methods measured by ``bench/recipes.py`` that convert does not ship, because
they did not make the FP8 model closer to bf16 (results in ``bench/results/recipes.md``):

* :func:`smooth_checkpoint`: SmoothQuant-style activation smoothing folded where the fold is
  exact in a Llama-style decoder — ``input_layernorm`` → q/k/v, ``post_attention_layernorm`` →
  gate/up (``norm.weight / s``, linear columns ``* s``), ``v_proj`` rows → ``o_proj`` columns
  (attention is linear in V per head; with GQA each value channel feeds ``heads / kv_heads``
  output channel groups) and ``up_proj`` rows → ``down_proj`` columns (SwiGLU is linear in the
  up branch). ``s_j = max|x_j|^α / max|W_:,j|^(1-α)``; α is chosen per fold site from
  {0, 0.25, 0.5, 0.75} by the FP8 output error of the affected layers on calibration inputs
  (per-token E4M3 inputs, per-tensor E4M3 weights with the fused group's shared scale, error
  in the original output units), so α = 0 (no smoothing) wins where smoothing does not help.
  Writes a high-precision checkpoint (norms in their source dtype, which is what an engine
  loads; smoothed linears in float32 so the FP8 conversion sees the exact fold); convert it
  as usual and verify it against the ORIGINAL checkpoint.
* :func:`search_weight_scales`: per-tensor weight scales chosen by output error instead of
  amax: for each layer (a fused group as one) the scale ``amax/448 · 2^(-j/32)``, j = 0..31,
  with the least ``tr(ΔW H ΔWᵀ)`` on calibration inputs (``H = Σ x xᵀ``, the same statistics
  ``--weight-rounding gptq`` uses) — output-error-optimal clipping, which also covers choosing
  per layer between the amax scale and a clipped one. Rewrites an FP8 folder's weights and
  scales in place (nearest rounding from the source weights).

Why neither helps FP8 (E4M3): a floating-point grid has the same relative step in every
binade, so scaling an input channel by ``1/s`` and its weight column by ``s`` leaves every
product's rounding error unchanged except for values that reach the subnormals (below
``amax · 2^-15`` of a token or tensor) — about 0.1 % of the inputs here. Clipping likewise buys
no resolution for the values it keeps; it only saves the few that sit in the subnormals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

ALPHAS = (0.0, 0.25, 0.5, 0.75)
SEARCH_STEPS = 32


def _fq(x: torch.Tensor, scale) -> torch.Tensor:
    from fp8export.numerics.fp8 import quantize_e4m3

    return quantize_e4m3(x, scale).to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32)


def _fq_token(x: torch.Tensor) -> torch.Tensor:
    a = x.abs().amax(-1, keepdim=True)
    s = torch.where(a > 0, a / 448.0, torch.ones_like(a))
    return _fq(x, s)


def _tensor_scale(*ws: torch.Tensor) -> torch.Tensor:
    return torch.tensor(np.float32(max(float(w.abs().max()) for w in ws) / 448.0))


def _rel_err(y: torch.Tensor, yq: torch.Tensor) -> float:
    return float(((y - yq) ** 2).sum() / (y * y).sum().clamp_min(1e-30))


def _capture(model, samples, modules: list[str]) -> dict[str, torch.Tensor]:
    """Inputs of ``modules`` on ``samples`` (real tokens only), float32 ``[tokens, in]``."""
    from fp8export.inputs.samples import iter_batches

    got: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
    state = {}

    def hook(name):
        def fn(_m, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])[state["rows"]]
            got[name].append(x.to(torch.bfloat16))
        return fn

    hooks = [model.get_submodule(m).register_forward_pre_hook(hook(m)) for m in modules]
    try:
        with torch.inference_mode():
            for b in iter_batches(samples, 8):
                state["rows"] = b.attention_mask.reshape(-1) > 0
                model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return {m: torch.cat(v).float() for m, v in got.items()}


def _factors(xmax: torch.Tensor, wmax: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 0.0:
        return torch.ones_like(xmax)
    s = xmax.clamp_min(1e-5) ** alpha / wmax.clamp_min(1e-5) ** (1 - alpha)
    return s.clamp_min(1e-5)


def smooth_checkpoint(src: Path, dst: Path, calib: Path, *, samples: int = 16,
                      seq_len: int = 128) -> dict:
    """Write a smoothed copy of the Llama-style checkpoint ``src`` to ``dst``; return the α
    chosen per fold site and its calibration output error against α = 0."""
    from safetensors.torch import load_file, save_file

    from fp8export.inputs.samples import load_samples
    from fp8export.models import load_model

    model, config = load_model(src, dtype=torch.float32, device="cpu")
    n_layers = config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or \
        config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rep = heads // kv
    data = load_samples(calib, src, max_samples=samples, seq_len=seq_len)
    names = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.q_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_proj",
                  f"{p}.mlp.down_proj"]
    xs = _capture(model, data, names)
    state = load_file(str(src / "model.safetensors"))
    w = {k: v.float() for k, v in state.items() if k.endswith("_proj.weight")}
    norms = {}
    chosen: dict[str, dict] = {}

    def site(key, candidates):
        errs = {a: candidates(a)[0] for a in ALPHAS}
        best = min(errs, key=lambda a: (errs[a], a))
        chosen[key] = {"alpha": best, "error": errs[best], "error_alpha0": errs[0.0]}
        return candidates(best)[1]

    for i in range(n_layers):
        p = f"model.layers.{i}"
        for norm, members, x_name in (
                ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 f"{p}.self_attn.q_proj"),
                ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"],
                 f"{p}.mlp.gate_proj")):
            x = xs[x_name]
            ws = [w[f"{p}.{m}.weight"] for m in members]
            ys = [x @ wm.T for wm in ws]

            def norm_site(alpha, x=x, ws=ws, ys=ys):
                s = _factors(x.abs().amax(0), torch.cat(ws).abs().amax(0), alpha)
                new = [wm * s for wm in ws]
                sc = _tensor_scale(*new)
                xq = _fq_token(x / s)
                err = sum(_rel_err(y, xq @ _fq(wm, sc).T) for y, wm in zip(ys, new))
                return err, (s, new)

            s, new = site(f"{p}.{norm}", norm_site)
            for m, wm in zip(members, new):
                w[f"{p}.{m}.weight"] = wm
            norms[f"{p}.{norm}.weight"] = s
            if norm == "input_layernorm":  # v -> o, after the norm fold changed v's columns
                xo, wv, wo = xs[f"{p}.self_attn.o_proj"], w[f"{p}.self_attn.v_proj.weight"], \
                    w[f"{p}.self_attn.o_proj.weight"]
                xv = x / s
                yv, yo = xv @ wv.T, xo @ wo.T
                qk = [w[f"{p}.self_attn.q_proj.weight"], w[f"{p}.self_attn.k_proj.weight"]]

                def vo_site(alpha, xv=xv, wv=wv, wo=wo, xo=xo, yv=yv, yo=yo, qk=qk):
                    xk = xo.abs().amax(0).reshape(kv, rep, head_dim).amax(1)
                    wk = wo.abs().amax(0).reshape(kv, rep, head_dim).amax(1)
                    s_kv = _factors(xk, wk, alpha).reshape(-1)  # per value channel
                    s_o = s_kv.reshape(kv, 1, head_dim).expand(kv, rep, head_dim).reshape(-1)
                    wv2, wo2 = wv / s_kv[:, None], wo * s_o[None, :]
                    sc = _tensor_scale(*qk, wv2)  # v shares the q/k/v scale
                    yv_q = (_fq_token(xv) @ _fq(wv2, sc).T) * s_kv[None, :]
                    yo_q = _fq_token(xo / s_o) @ _fq(wo2, _tensor_scale(wo2)).T
                    return _rel_err(yv, yv_q) + _rel_err(yo, yo_q), (wv2, wo2)

                wv2, wo2 = site(f"{p}.v->o", vo_site)
                w[f"{p}.self_attn.v_proj.weight"], w[f"{p}.self_attn.o_proj.weight"] = wv2, wo2
        # up -> down, after the norm fold changed up's columns
        xd = xs[f"{p}.mlp.down_proj"]
        wu, wd, wg = (w[f"{p}.mlp.{m}_proj.weight"] for m in ("up", "down", "gate"))
        xg = xs[f"{p}.mlp.gate_proj"] / norms[f"{p}.post_attention_layernorm.weight"]
        yu, yd = xg @ wu.T, xd @ wd.T

        def ud_site(alpha, xg=xg, wu=wu, wd=wd, wg=wg, xd=xd, yu=yu, yd=yd):
            s = _factors(xd.abs().amax(0), wd.abs().amax(0), alpha)
            wu2, wd2 = wu / s[:, None], wd * s[None, :]
            yu_q = (_fq_token(xg) @ _fq(wu2, _tensor_scale(wg, wu2)).T) * s[None, :]
            yd_q = _fq_token(xd / s) @ _fq(wd2, _tensor_scale(wd2)).T
            return _rel_err(yu, yu_q) + _rel_err(yd, yd_q), (wu2, wd2)

        wu2, wd2 = site(f"{p}.up->down", ud_site)
        w[f"{p}.mlp.up_proj.weight"], w[f"{p}.mlp.down_proj.weight"] = wu2, wd2
    out = dict(state)
    for k, v in w.items():
        out[k] = v.contiguous()  # float32: the FP8 conversion sees the exact fold
    for k, s in norms.items():
        out[k] = (state[k].float() / s).to(state[k].dtype)  # what an engine loads
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    alphas = [c["alpha"] for c in chosen.values()]
    return {"sites": len(chosen), "alpha_counts": {str(a): alphas.count(a) for a in ALPHAS},
            "calib_error": sum(c["error"] for c in chosen.values()),
            "calib_error_alpha0": sum(c["error_alpha0"] for c in chosen.values()),
            "samples": len(data)}


def search_weight_scales(folder: Path, reference: Path, calib: Path, *, samples: int = 64,
                         seq_len: int = 128) -> dict:
    """Replace the per-tensor weight scales of the FP8 ``folder`` (converted from
    ``reference``) by the output-error-optimal ones; return how many changed and the
    calibration output error against the amax scales."""
    from safetensors.torch import load_file, save_file

    from fp8export.calibration.hessian import input_hessians
    from fp8export.numerics.fp8 import quantize_e4m3
    from fp8export.numerics.gptq import output_error

    man = json.loads((folder / "fp8export.json").read_text())
    quantized = man["quantized"]
    groups: dict[str, list[str]] = {}
    for m, row in quantized.items():
        groups.setdefault(row.get("fused_group") or m, []).append(m)
    src = load_file(str(reference / "model.safetensors"))
    hess = input_hessians(reference, calib, list(quantized), {g: ms for g, ms in groups.items()
                                                              if len(ms) > 1},
                          samples=samples, seq_len=seq_len, batch_size=8, device="cpu")
    tensors = load_file(str(folder / "model.safetensors"))
    changed, gains = 0, []
    for members in groups.values():
        h, _ = hess.of(members[0])
        ws = [src[f"{m}.weight"].float() for m in members]
        cat = torch.cat(ws)
        base = float(tensors[f"{members[0]}.weight_scale"].reshape(-1)[0])
        errs = []
        for j in range(SEARCH_STEPS):
            s = np.float32(base * 2.0 ** (-j / SEARCH_STEPS))
            errs.append((output_error(cat, _fq(cat, s), h), j, s))
        best = min(errs)
        if best[0] > 0:
            gains.append(10 * np.log10(errs[0][0] / best[0]))
        if best[1]:
            changed += 1
        for m, wm in zip(members, ws):
            tensors[f"{m}.weight"] = quantize_e4m3(wm, best[2])
            tensors[f"{m}.weight_scale"] = torch.tensor([best[2]], dtype=torch.float32)
            quantized[m]["weight_scale"] = float(best[2])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    man["notes"].append("bench/recipe_methods.py: weight scales replaced by output-error search")
    (folder / "fp8export.json").write_text(json.dumps(man, indent=1, sort_keys=True))
    return {"groups": len(groups), "changed": changed,
            "calib_output_gain_db_median": float(np.median(gains)) if gains else None,
            "calib_output_gain_db_max": float(np.max(gains)) if gains else None}
