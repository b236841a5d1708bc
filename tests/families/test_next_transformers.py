"""The newer families' FP8 folders as transformers loads them: ``from_pretrained(folder)`` in
its default configuration (compressed-tensors installed), the class config.json names.

For each family (every one but Llama 4, whose forward transformers 5.2x cannot run): the
loading reports no missing and no unexpected tensor, compressed-tensors quantizes exactly the
manifest's layers that transformers builds as ``nn.Linear`` (MoE experts it builds as 3-D
parameters: it dequantizes them on load), the modules kept in high precision hold the
source's bf16 weights bit for bit, and greedy generation of 8 tokens is compared with the bf16
model's: KL and top-1 agreement of the logits over the bf16 model's generated sequence
(teacher-forced), with the family matrix's thresholds. LLaVA is also run with an image, which
only a vision tower loaded as kept can pass. Whisper's ``generate`` fails until one forward
call has decompressed the model (compressed-tensors' first-forward hook; pinned below).
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_generate import NEW_TOKENS, generate, kl_top1, load, logits, prompt
from next_families import NEXT_FAMILIES
from test_family_matrix import THRESHOLDS

LOADS = [f for f in NEXT_FAMILIES if f != "llama4"]


def _from_fp8(key: str, modules) -> bool:
    """Whether state ``key`` holds FP8 weights the loader dequantized: a quantized linear's,
    or the 3-D experts parameter built from the per-expert FP8 linears under its module."""
    parent = key.rpartition(".")[0]
    return any(m == parent or m.startswith(f"{parent}.") for m in modules)


@pytest.mark.parametrize("family", LOADS)
def test_from_pretrained_generates_like_bf16(family, next_dir, next_fp8, media_data):
    src, fp8 = next_dir(family), next_fp8(family)
    ref, _ = load(src)
    model, info = load(fp8)
    assert not info["missing_keys"], info
    # transformers builds MoE experts as 3-D parameters: it dequantizes their FP8 weights into
    # them and has no use for their static input scales (vLLM runs them in FP8)
    unexpected = {k for k in info["unexpected_keys"]
                  if not (".experts." in k and k.endswith(".input_scale"))}
    assert not unexpected, sorted(unexpected)[:6]
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    quantized = {n for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    from fp8export.models import module_names

    expected = {n for n in module_names(model, manifest["quantized"]).values() if n in linears}
    assert quantized == expected, sorted(quantized ^ expected)[:6]
    inputs = prompt(family, src, media_data)
    kept = ref.state_dict()
    seq = generate(ref, inputs)
    if family == "whisper":
        # compressed-tensors decompresses on the model's first forward (a pre-hook on the top
        # module); Whisper's generate calls the encoder first, which then multiplies bf16 by
        # the E4M3 codes. Upstream, for any compressed-tensors FP8 Whisper (llm-compressor's
        # too): one forward call first, as users must.
        with pytest.raises(RuntimeError, match="same dtype"):
            generate(model, inputs, 1)
        logits(model, inputs, inputs["decoder_input_ids"])
    ours = generate(model, inputs)
    state = model.state_dict()  # after the first forward: decompressed
    # Whisper's generate returns the new tokens without the decoder prompt
    assert seq.shape == ours.shape and seq.shape[1] >= NEW_TOKENS
    kl, top1 = kl_top1(logits(ref, inputs, seq), logits(model, inputs, seq))
    assert kl <= THRESHOLDS["kl_mean"] and top1 >= THRESHOLDS["top1_agreement"], \
        (family, kl, top1)
    fp8_modules = module_names(model, manifest["quantized"]).values()
    unchanged = [k for k in kept if k in state and not _from_fp8(k, fp8_modules)]
    differ = [k for k in unchanged if not torch.equal(kept[k], state[k])]
    assert not differ, differ[:5]  # kept modules (towers, routers, norms) as in the source


def test_llava_with_an_image_as_transformers_loads_it(next_dir, next_fp8, media_data):
    """The image goes through the kept CLIP tower and projector: logits as bf16's."""
    from PIL import Image
    from transformers import AutoProcessor

    src = next_dir("llava")
    ref, _ = load(src)
    model, _ = load(next_fp8("llava"))
    image = Image.open(media_data / "img3.png").convert("RGB")
    inputs = AutoProcessor.from_pretrained(src)(text=["<image>a photo of"], images=[image],
                                                return_tensors="pt")
    with torch.no_grad():
        kl, top1 = kl_top1(ref(**inputs).logits, model(**inputs).logits)
    assert kl <= THRESHOLDS["kl_mean"] and top1 >= THRESHOLDS["top1_agreement"], (kl, top1)
