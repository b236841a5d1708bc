"""Run llm-compressor's FP8 (static per-tensor) recipe on a model folder: the peer reference.

Runs inside the peer venv (``scripts/peer_venv.sh``: llmcompressor with its own transformers
and compressed-tensors pins), never in the dev venv. Usage:
``python llmcompressor_fp8.py MODEL_DIR CALIB_TXT OUT_DIR [SAMPLES]``. The recipe is
llm-compressor's MoE FP8 example: every Linear with static FP8 weights and inputs, ``lm_head``
and the MoE routers ignored, every expert calibrated on every token (its default).
"""

import sys


def main(model_dir: str, calib: str, out: str, samples: int = 16) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = [s for s in open(calib, encoding="utf-8").read().splitlines() if s.strip()][:samples]
    data = Dataset.from_dict({k: v for k, v in tok(lines, truncation=True, max_length=64).items()
                              if k in ("input_ids", "attention_mask")})
    recipe = QuantizationModifier(targets="Linear", scheme="FP8",
                                  ignore=["lm_head", "re:.*mlp.gate$",
                                          "re:.*block_sparse_moe.gate$"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=64,
            num_calibration_samples=len(lines))
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
