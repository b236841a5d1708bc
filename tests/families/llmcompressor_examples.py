"""Run llm-compressor's own FP8 example recipes on tiny models of the newer families.

Runs inside the peer venv (``scripts/peer_venv.sh``: llmcompressor with its own transformers and
compressed-tensors pins), never in the dev venv, one process for every family (llmcompressor
takes seconds to import). Usage: ``python llmcompressor_examples.py OUT_ROOT FAMILY=MODEL_DIR
...``; writes ``OUT_ROOT/FAMILY``. Each recipe is the one of llm-compressor's example for that
family, data-free (``examples/quantization_w8a8_fp8/``):

* ``qwen2.5-vl``: ``qwen_2_5_vl_example.py``: FP8_DYNAMIC, ignore lm_head and the vision tower;
* ``llava``: ``llava1.5_example.py``: FP8_DYNAMIC, ignore lm_head, the tower and the projector;
* ``deepseek-v3``: the FP8_BLOCK preset of ``fp8_block_example.py`` (the format DeepSeek-V3
  ships), with the MoE examples' router ignore (``re:.*mlp.gate$``).
"""

import sys

RECIPES = {
    "qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", "FP8_DYNAMIC",
                   ["lm_head", "re:visual.*", "re:model.visual.*"]),
    "llava": ("LlavaForConditionalGeneration", "FP8_DYNAMIC",
              ["re:.*lm_head", "re:multi_modal_projector.*", "re:vision_tower.*"]),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "FP8_BLOCK", ["lm_head", "re:.*mlp.gate$"]),
}


def main(out_root: str, *pairs: str) -> None:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    for pair in pairs:
        family, _, model_dir = pair.partition("=")
        arch, scheme, ignore = RECIPES[family]
        model = getattr(transformers, arch).from_pretrained(model_dir, dtype="auto")
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
                                                         ignore=ignore))
        model.save_pretrained(f"{out_root}/{family}", save_compressed=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
