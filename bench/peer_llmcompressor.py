"""llm-compressor's FP8 recipes on a model folder, for bench/margin.py (the peer reference).

Runs inside the peer venv (``scripts/peer_venv.sh``: llmcompressor with its own transformers
and compressed-tensors pins), never in the dev venv:
``python bench/peer_llmcompressor.py SCHEME MODEL_DIR OUT_DIR [CALIB_TXT SAMPLES SEQ_LEN]``.

SCHEME: ``FP8_DYNAMIC`` (per-channel weights, dynamic per-token inputs; data-free),
``FP8_BLOCK`` (128x128 block weights, per-token-group inputs; data-free) or
``GPTQ_FP8_DYNAMIC`` / ``GPTQ_FP8_BLOCK`` (GPTQModifier with that scheme, calibrated on
CALIB_TXT; llm-compressor's GPTQ rounds on block scales too).
``lm_head`` stays in high precision, as in llm-compressor's examples.
"""

import sys


def main(scheme: str, model_dir: str, out: str, calib: str | None = None, samples: int = 128,
         seq_len: int = 128) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tok = AutoTokenizer.from_pretrained(model_dir)
    if scheme.startswith("GPTQ_"):
        from datasets import Dataset
        from llmcompressor.modifiers.quantization import GPTQModifier

        lines = [s for s in open(calib, encoding="utf-8").read().splitlines()
                 if s.strip()][:samples]
        enc = tok(lines, truncation=True, max_length=seq_len)
        data = Dataset.from_dict({k: v for k, v in enc.items()
                                  if k in ("input_ids", "attention_mask")})
        recipe = GPTQModifier(targets="Linear", scheme=scheme.removeprefix("GPTQ_"),
                              ignore=["lm_head"])
        oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=seq_len,
                num_calibration_samples=len(lines))
    else:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], *(a[3:4]), *(int(x) for x in a[4:6]))
