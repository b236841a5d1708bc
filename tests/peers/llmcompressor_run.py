"""Run one of llm-compressor's FP8 schemes on a model folder: the peer's own output.

Runs inside the peer venv (``scripts/peer_venv.sh``: llmcompressor with its own transformers
and compressed-tensors pins), never in the dev venv. Usage:
``python llmcompressor_run.py SCHEME MODEL_DIR OUT_DIR [CALIB_TXT [SAMPLES]]``. ``SCHEME`` is a
compressed-tensors preset (``FP8_DYNAMIC``, ``FP8_BLOCK``: data-free; ``FP8``: static, needs
calibration text). Every Linear but ``lm_head`` is quantized, as llm-compressor's examples do.
"""

import sys


def main(scheme: str, model_dir: str, out: str, calib: str | None = None,
         samples: int = 16) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    if calib is None:
        oneshot(model=model, recipe=recipe)
    else:
        from datasets import Dataset

        tok = AutoTokenizer.from_pretrained(model_dir)
        lines = [s for s in open(calib, encoding="utf-8").read().splitlines()
                 if s.strip()][:samples]
        enc = tok(lines, truncation=True, max_length=64)
        data = Dataset.from_dict({k: v for k, v in enc.items()
                                  if k in ("input_ids", "attention_mask")})
        oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=64,
                num_calibration_samples=len(lines))
    model.save_pretrained(out, save_compressed=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(sys.argv[4:5]),
         *(int(a) for a in sys.argv[5:6]))
