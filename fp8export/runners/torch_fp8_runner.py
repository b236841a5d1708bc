"""The torch FP8 runtime as a runner: weights in E4M3, ``torch._scaled_mm`` where possible."""

from __future__ import annotations

from typing import Any

from fp8export.runners.torch_runner import TorchModelRunner

COMPILE_MODES = (False, True, "auto", "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")

# Why "auto" runs eager: on an H100 (bench/results/gpu_fp8.md) torch.compile with CUDA graphs
# took 21-25 s per new input shape for the 1.1 B Llama and saved at most ~20 ms a forward, while
# verify feeds tens of batches whose shapes vary: compiling never pays back within one run.
AUTO_EAGER_REASON = ("eager: verify feeds a few batches of varying shapes; torch.compile / "
                     "CUDA graphs cost ~20 s of compile per shape, more than they save")


class TorchFp8Runner(TorchModelRunner):
    """Runs an FP8 folder. ``mode``: "auto" | "emulate" | "scaled_mm" (see fp8_linear.py);
    ``kv_cache``/``attention``: as ``load_fp8_model`` takes them (runtime/attention.py).

    ``compile``: "auto" (eager; see ``AUTO_EAGER_REASON``), False, True (``torch.compile``
    default mode: Inductor fuses each activation quantize into its producer) or a
    ``torch.compile`` mode name; ``"reduce-overhead"`` also captures CUDA graphs (fixed shapes
    pay off; each new shape recompiles). Numerics match up to float rounding (fusion reorders
    bf16 operations). ``describe()`` says which path ran.
    """

    backend = "torch-fp8"

    def __init__(self, path, *, dtype: str = "bf16", device: str = "auto", mode: str = "auto",
                 compile: bool | str = "auto", name: str | None = None,
                 max_memory: dict[int | str, int] | None = None, kv_cache: str = "auto",
                 attention: str = "bf16"):
        super().__init__(path, dtype=dtype, device=device, name=name, max_memory=max_memory)
        if compile not in COMPILE_MODES:
            from fp8export.errors import Fp8ExportError

            raise Fp8ExportError(f"compile={compile!r} is unknown; use one of "
                                 f"{', '.join(map(str, COMPILE_MODES))}.")
        self.mode = mode
        self.kv_cache, self.attention = kv_cache, attention
        self.compile = compile
        self.info: dict[str, Any] = {}
        self.execution: dict[str, str] = {}

    def _build(self):
        import torch

        from fp8export.models import checkpoint_bytes
        from fp8export.runtime.fp8_model import load_fp8_model

        spread = self._budgets(lambda: checkpoint_bytes(self.path, None))
        device = self.device
        if spread is not None:
            gpus = [k for k in spread if isinstance(k, int)]
            device = f"cuda:{gpus[0]}" if gpus else "cpu"
        model, config, self.manifest, self.info = load_fp8_model(
            self.path, device=device, dtype=self.dtype, mode=self.mode, budgets=spread,
            kv_cache=self.kv_cache, attention=self.attention)
        self.placement = self.info.pop("placement", None)
        if self.compile in (False, "auto"):
            why = AUTO_EAGER_REASON if self.compile == "auto" else "eager: compile=False"
            if self.info["mode"] == "emulate":
                why = "eager: emulation (no FP8 GEMMs on this device)"
            self.execution = {"execution": "eager", "execution_reason": why}
        else:
            mode = self.compile if isinstance(self.compile, str) else None
            model = torch.compile(model, mode=mode)
            graphs = mode == "reduce-overhead"
            self.execution = {"execution": "torch.compile" + (" + CUDA graphs" if graphs else ""),
                              "execution_reason": f"compile={self.compile!r}"}
        return model, config

    def attention_variants(self) -> list[tuple[str, str]]:
        """What runs beside the judged model for the KV/attention cost: ``(label, mode)`` of
        the FP8-linears-only model, and with FP8 attention also the KV-cache-only one; empty
        unless ``--kv-cache fp8`` or ``--attention fp8`` was asked for."""
        if self.kv_cache != "fp8" and self.attention != "fp8":
            return []
        variants = [("FP8 linears only (bf16 KV cache and attention)", "off")]
        if self.attention == "fp8":
            variants.append(("+ FP8 KV cache (bf16 attention)", "kv"))
        return variants

    def judged_variant(self) -> str:
        """Label of the configuration the verdict judges."""
        if self.attention == "fp8":
            return "+ FP8 KV cache + FP8 attention (judged)"
        if self.info.get("kv_cache"):
            return "+ FP8 KV cache (judged)"
        return "FP8 linears only (judged)"

    def attention_setup(self) -> dict[str, Any]:
        return {"kv_cache": self.info.get("kv_cache"), "attention": self.attention}

    def set_attention(self, mode: str) -> None:
        """Run the next batches with attention mode "off", "kv" or "fp8" (attention.set_mode),
        or "judged": the mode the runner was opened with."""
        from fp8export.runtime.attention import set_mode

        if mode == "judged":
            mode = "fp8" if self.attention == "fp8" else "kv"
        set_mode(self.model, mode)

    def fp8_path(self) -> str:
        """One line: which FP8 GEMM path runs, and what is fused."""
        info = self.info
        if not info:
            return "not loaded"
        if info.get("mode") == "emulate":
            gemm = "emulated FP8 (fake-quantize + fp32 matmul)"
        else:
            from fp8export.runtime.fp8_gemm import EAGER_M

            gemm = "torch._scaled_mm" + (f" (eager, <= {EAGER_M} rows: one-launch Triton FP8 "
                                         "GEMM)" if EAGER_M else "")
            if info.get("weight_granularity") == "block":
                gemm = ("block-scaled FP8 GEMMs with per-token-group inputs (cuBLAS "
                        "torch._scaled_mm on compute capability 9.0, else a Triton kernel)")
        fused = info.get("fused_groups", 0)
        kv = f"; KV cache {info['kv_cache']}" if info.get("kv_cache") else ""
        return (f"{gemm}; {fused} fused q/k/v and gate/up groups" if fused else gemm) + kv + \
            f"; {self.execution.get('execution', 'eager')}"

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(mode=self.info.get("mode", self.mode), fallbacks=self.info.get("fallbacks", {}),
                 fused_groups=self.info.get("fused_groups", 0),
                 unfused_groups=self.info.get("unfused_groups", {}),
                 kv_cache=self.info.get("kv_cache"),
                 fp8_path=self.fp8_path(), **self.execution)
        if self.info.get("moe"):
            from fp8export.moe import expert_summary

            d["moe"] = (expert_summary(self.model) if self.model is not None else None) \
                or self.info["moe"]
        return d
