#!/usr/bin/env python
"""Where a decoder's FP8 error comes from, and which weight-side techniques lower it: an
in-process exploration on one real model, measured on held-out text by one metric code.

    python bench/margin_explore.py --model samples/smollm2/model

Every variant simulates what a written folder computes (E4M3 weights with their scales,
dynamic E4M3 inputs per token or per group of 128) by replacing the decoder's linears with
quantize-dequantize layers, and is judged as ``bench/margin.py`` judges folders: KL(bf16 ‖
candidate) per token on ``--eval-samples`` lines of ``eval.txt`` (disjoint from the
calibration lines), with verify's bootstrap interval. The decomposition rows (inputs only,
weights only) bound what any weight-side technique can reach. Techniques:

- ``gptq``: GPTQ with each layer's ``H`` from the bf16 model's inputs (convert's
  ``--weight-rounding gptq``);
- ``seq``: ``H`` from the inputs the layer gets in the already-quantized model (llm-compressor's
  sequential pipeline; convert's ``gptq-sequential``);
- ``asym``: the layer's target is the *bf16* model's output ``W x`` while it is fed the
  quantized model's E4M3 inputs ``z``: first the least-squares weight ``W* = W E[x zᵀ]
  E[z zᵀ]⁻¹`` (it absorbs the error of the layers before and of the input quantization in
  expectation), then GPTQ of ``W*`` on ``H = E[z zᵀ]`` (GPTAQ-style asymmetric calibration).
  The written folder is the same format: E4M3 weights and scales.

Writes ``bench/results/margin_explore-<label>.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import machine_info  # noqa: E402
from bench.margin import kl_to_reference  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data"
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
          ("down_proj",))
VARIANTS = {
    # name: (weights, act, rounding, hessian source, asym)
    "bf16 (no FP8)": (None, None, None, None, False),
    "inputs only, per token": (None, "token", None, None, False),
    "inputs only, per group 128": (None, "group", None, None, False),
    "weights only, channel": ("channel", None, "nearest", None, False),
    "channel + token": ("channel", "token", "nearest", None, False),
    "channel + token, gptq": ("channel", "token", "gptq", "float", False),
    "channel + token, gptq seq": ("channel", "token", "gptq", "seq", False),
    "channel + token, asym + gptq": ("channel", "token", "gptq", "seq", True),
    "channel + token, asym nearest": ("channel", "token", "nearest", "seq", True),
    "block + group": ("block", "group", "nearest", None, False),
    "block + group, gptq": ("block", "group", "gptq", "float", False),
    "block + group, asym + gptq": ("block", "group", "gptq", "seq", True),
}


def act_qdq(x, mode: str):
    from fp8export.numerics.block import fake_quantize_groups

    return fake_quantize_groups(x, x.shape[-1] if mode == "token" else 128)


def make_qlinear_class():
    import torch
    import torch.nn.functional as F

    class _QLinear(torch.nn.Module):
        """A linear whose input is quantized per ``act`` and whose weight is already the
        dequantized E4M3 one; ``capture`` (a list) receives the raw inputs."""

        def __init__(self, weight, act=None):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.act = act
            self.capture = None

        def forward(self, x):
            if self.capture is not None:
                self.capture.append(x.detach().reshape(-1, x.shape[-1]).float())
            if self.act is not None:
                x = act_qdq(x, self.act).to(x.dtype)
            # 16-bit inputs are multiplied in fp32 and rounded once (fp8export.cpu_gemm)
            return F.linear(x.float(), self.weight.float()).to(x.dtype)

    return _QLinear


def weight_scale(w, gran: str):
    import torch

    from fp8export.numerics.block import expand_blocks

    if gran == "channel":
        a = w.abs().amax(1, keepdim=True)
        return torch.where(a > 0, a / 448.0, torch.ones_like(a)).expand_as(w)
    bn = bk = 128
    out, inn = w.shape
    pad = torch.nn.functional.pad(w.abs(), (0, (-inn) % bk, 0, (-out) % bn))
    a = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax((1, 3))
    s = torch.where(a > 0, a / 448.0, torch.ones_like(a))
    return expand_blocks(s, tuple(w.shape), (bn, bk))


def nearest(w, s):
    import torch

    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def quantize_weight(w, gran, rounding, h, cross, asym):
    """The dequantized E4M3 weight of ``w`` (fp32 ``[out, in]``)."""
    import torch

    from fp8export.numerics.gptq import gptq_round

    if asym:
        hd = h.double().clone()
        dead = hd.diagonal() <= 0
        hd.diagonal().add_(0.01 * float(hd.diagonal().mean()))
        hd[dead, dead] = 1.0
        # W* = W C H⁻¹ with C = E[x zᵀ]: solve H W*ᵀ = (W C)ᵀ
        w = torch.linalg.solve(hd, (w.double() @ cross.double()).T).T.float()
    s = weight_scale(w, gran)
    if rounding == "nearest" or h is None:
        return nearest(w, s)
    r = gptq_round(w, h, s)
    return r.codes.float() * s


def hadamard(n: int, seed: int = 0):
    """A random orthogonal ``n x n`` matrix with Hadamard structure where one exists
    (Sylvester for powers of two, times Paley's order-12 matrix for 576 = 12·12·4), with
    random signs on its rows; else a random orthogonal one (QR of a Gaussian)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def sylvester(k):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < k:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return h

    def paley12():
        q = 11
        residues = {(i * i) % q for i in range(1, q)}
        chi = [0] + [1 if i in residues else -1 for i in range(1, q)]
        qm = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)],
                          dtype=torch.float64)
        s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = qm
        return s + torch.eye(q + 1, dtype=torch.float64)

    m = None
    if n & (n - 1) == 0:
        m = sylvester(n)
    elif n % 144 == 0 and (n // 144) & (n // 144 - 1) == 0:
        p = paley12()
        m = torch.kron(torch.kron(p, p), sylvester(n // 144))
    if m is None or not torch.allclose(m @ m.T, n * torch.eye(n, dtype=torch.float64)):
        q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (signs[:, None] * m / n ** 0.5).float()


def rotate_residual(model, seed: int = 0) -> None:
    """Rotate the residual stream of a Llama-shaped ``model`` (fp32, in place) by an
    orthogonal ``Q``, absorbed into the weights (QuaRot/SpinQuant without online rotations):
    each RMSNorm's weight folded into the linears it feeds (norms become 1), embeddings and
    head untied, ``E ← E Q``, readers of the stream ``W ← W Q``, writers ``W ← Qᵀ W``. The
    function is unchanged (RMSNorm with unit weight commutes with ``Q``); the folder is a plain
    Llama with ``tie_word_embeddings: false``."""
    import torch

    inner = model.model
    q = hadamard(model.config.hidden_size, seed)
    with torch.no_grad():
        head = model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        head.weight.mul_(inner.norm.weight[None, :])
        inner.norm.weight.fill_(1.0)
        head.weight.copy_(head.weight @ q)
        emb = inner.embed_tokens.weight
        emb.copy_(emb @ q)
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            for norm, readers in ((layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj)),
                                  (layer.post_attention_layernorm, (m.gate_proj, m.up_proj))):
                for r in readers:
                    r.weight.copy_((r.weight * norm.weight[None, :]) @ q)
                norm.weight.fill_(1.0)
            for w in (a.o_proj, m.down_proj):
                w.weight.copy_(q.T @ w.weight)


def capture_layer_inputs(model, batches):
    """The first decoder layer's inputs (hidden states and keyword arguments) per batch."""
    import torch

    layer0 = model.model.layers[0]
    got = []

    class Stop(Exception):
        pass

    def hook(_m, args, kwargs):
        got.append((args[0] if args else kwargs.pop("hidden_states"), kwargs))
        raise Stop

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            for ids, mask in batches:
                try:
                    model(input_ids=ids, attention_mask=mask, use_cache=False)
                except Stop:
                    pass
    finally:
        handle.remove()
    out = []
    for h, kw in got:
        kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "cache")}
        kw["use_cache"] = False
        out.append((h.float(), kw))
    return out


def run_layer(layer, states):
    import torch

    outs = []
    with torch.inference_mode():
        for h, kw in states:
            o = layer(h, **kw)
            outs.append((o[0] if isinstance(o, tuple) else o, kw))
    return outs


def swap_linears(layer, qcls, dtype):
    """Replace the layer's linears by quantize-dequantize ones (weights unchanged, no input
    quantization yet); returns ``{name: module}``."""
    out = {}
    for attr in ("self_attn", "mlp"):
        parent = getattr(layer, attr)
        for name, child in list(parent.named_children()):
            if name.endswith("_proj"):
                q = qcls(child.weight.detach().to(dtype).clone())
                setattr(parent, name, q)
                out[name] = q
    return out


def quantize_model(model32, calib_states, valid, spec, qcls):
    """Quantize ``model32``'s decoder layers (fp32, modified in place) per ``spec``; returns
    ``{layer index: {linear name: dequantized fp32 weight}}``. ``valid`` selects the real
    (unpadded) tokens of the captured inputs."""
    import torch

    gran, act, rounding, hsrc, asym = spec
    result = {}
    h_f = h_q = calib_states
    layers = model32.model.layers
    for li, layer in enumerate(layers):
        lin = swap_linears(layer, qcls, torch.float32)
        weights = {n: m.weight.detach().clone() for n, m in lin.items()}
        if gran is None:
            for m in lin.values():
                m.act = act
            result[li] = {}
            continue
        if hsrc is None:
            result[li] = {}
            for name, m in lin.items():
                m.weight.data.copy_(quantize_weight(weights[name], gran, "nearest", None, None,
                                                    False))
                m.act = act
                result[li][name] = m.weight.detach().clone()
            continue
        for g in GROUPS:
            lin[g[0]].capture = []
        next_f = run_layer(layer, h_f)  # original weights, no input quantization yet
        xs = {}
        for g in GROUPS:
            xs[g[0]] = torch.cat(lin[g[0]].capture)[valid]
            lin[g[0]].capture = None
        quantized = {}
        for g in GROUPS:
            cross = None
            if hsrc == "float":
                h = xs[g[0]].T @ xs[g[0]]
            else:
                lin[g[0]].capture = []
                run_layer(layer, h_q)
                z = torch.cat(lin[g[0]].capture)[valid]
                lin[g[0]].capture = None
                if asym:
                    z = act_qdq(z, act)
                    cross = xs[g[0]].T @ z
                h = z.T @ z
            for name in g:
                wq = quantize_weight(weights[name], gran, rounding, h, cross, asym)
                lin[name].weight.data.copy_(wq)
                lin[name].act = act
                quantized[name] = wq
        result[li] = quantized
        if li < len(layers) - 1:
            if hsrc == "seq":
                h_q = run_layer(layer, h_q)
            h_f = next_f
    return result


def evaluate(model, batches, ref_rows, per_sample):
    """KL(reference ‖ ``model``) per token, the model (quantized in fp32) run in bf16 as the
    FP8 runtime runs a folder."""
    import torch

    from fp8export.cpu_gemm import fp32_linears

    # parameters to bf16 as a loaded folder has them; buffers (RoPE's inverse frequencies)
    # stay float32 as transformers keeps them
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model = fp32_linears(model.to(torch.bfloat16))
    for n, b in buffers.items():
        mod, _, attr = n.rpartition(".")
        setattr(model.get_submodule(mod), attr, b)
    row = kl_to_reference(model, batches, ref_rows, per_sample)
    row.pop("tokens")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "samples" / "smollm2" / "model")
    ap.add_argument("--label", default="smollm2")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of bench/results/margin_explore-<label>.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (GPTQ's small steps slow down badly on a busy machine)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS),
                    help="names of VARIANTS, each optionally prefixed 'rotated ' (the "
                         "residual stream rotated first)")
    args = ap.parse_args()
    import torch

    from fp8export.inputs.eval_data import load_verify_samples
    from fp8export.inputs.samples import iter_batches

    torch.set_num_threads(args.threads)
    cfg = json.loads((args.model / "config.json").read_text())
    doc = {"machine": machine_info(REPO), "model": args.label,
           "calib": {"data": "calib.txt", "samples": args.calib_samples},
           "eval": {"data": "eval.txt", "samples": args.eval_samples, "seq_len": args.seq_len},
           "rows": []}
    out = REPO / "bench" / "results" / f"margin_explore-{args.label}"

    def batches_of(name, n):
        s, _ = load_verify_samples(DATA / name, args.model, cfg, samples=n,
                                   seq_len=args.seq_len)
        return [(b.input_ids, b.attention_mask) for b in iter_batches(s, args.batch)]

    if args.resume and out.with_suffix(".json").is_file():
        # rows of an earlier run with the same data, kept; its variants are not run again
        old = json.loads(out.with_suffix(".json").read_text())
        if (old["calib"], old["eval"]) != (doc["calib"], doc["eval"]):
            sys.exit(f"{out}.json: measured on other data; drop --resume")
        doc["rows"] = old["rows"]
        doc["earlier_machine"] = old.get("earlier_machine", []) + [old["machine"]]
    done = {r["variant"] for r in doc["rows"]}
    todo = [v for v in args.variants if v not in done]
    if todo:
        run_variants(args, doc, out, todo, batches_of)
    elif args.resume:
        doc = old  # nothing new: the report of the stored rows as they were measured
    write_report(args, doc, out)


def run_variants(args, doc, out, todo, batches_of) -> None:
    import torch

    from fp8export.models import load_model

    qcls = make_qlinear_class()
    evalb = batches_of("eval.txt", args.eval_samples)
    calibb = batches_of("calib.txt", args.calib_samples)
    ref_model, _ = load_model(args.model, dtype=torch.bfloat16, device="cpu")
    with torch.inference_mode():
        ref_rows = [ref_model(input_ids=i, attention_mask=m).logits[m > 0] for i, m in evalb]
    per_sample = [int(n) for _, m in evalb for n in (m > 0).sum(1)]
    valid = torch.cat([m.reshape(-1) > 0 for _, m in calibb])
    del ref_model
    for name in todo:
        rotate = name.startswith("rotated ")
        spec = VARIANTS[name.removeprefix("rotated ")]
        t0 = time.perf_counter()
        model32, _ = load_model(args.model, dtype=torch.float32, device="cpu")
        if rotate:
            rotate_residual(model32)
        states = capture_layer_inputs(model32, calibb)
        quantize_model(model32, states, valid, spec, qcls)
        qs = time.perf_counter() - t0
        row = {"variant": name, "spec": list(spec), "quantize_s": round(qs, 1),
               **evaluate(model32, evalb, ref_rows, per_sample)}
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")


def write_report(args, doc, out) -> None:
    lines = [f"# {args.label}: where the FP8 error comes from, and weight-side techniques", "",
             f"In-process simulation of E4M3 weights and dynamic E4M3 inputs; KL(bf16 ‖ "
             f"candidate) per token on {args.eval_samples} held-out lines of eval.txt x "
             f"{args.seq_len} tokens; {args.calib_samples} calibration lines of calib.txt; "
             f"CPU, load {doc['machine']['load_avg_1m_at_start']} at start"
             + "".join(f"; earlier rows from a run at load {m['load_avg_1m_at_start']}"
                       for m in doc.get("earlier_machine", [])) + ".", "",
             "| variant | KL mean [95%] | top-1 | quantize s |", "|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['variant']} | {r['kl_mean']:.4f} [{r['interval'][0]:.4f}, "
                     f"{r['interval'][1]:.4f}] | {r['top1_agreement']:.4f} | "
                     f"{r['quantize_s']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
