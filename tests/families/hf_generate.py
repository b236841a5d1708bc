"""A folder as transformers loads it (``from_pretrained``, default configuration) generating
next to the bf16 model: shared by ``test_next_transformers.py`` and ``bench/families.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

NEW_TOKENS = 8


def load(folder: Path):
    """``(model, loading info)`` of the class config.json names, as a user loads it."""
    import transformers

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def kl_top1(ref: torch.Tensor, cand: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || cand) of the next-token distributions, and top-1 agreement."""
    ref, cand = ref.float().log_softmax(-1), cand.float().log_softmax(-1)
    kl = torch.nn.functional.kl_div(cand, ref, log_target=True, reduction="none").sum(-1)
    return kl.mean().item(), (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()


def prompt(family: str, src: Path, media: Path) -> dict:
    """16 token ids; Whisper: the features of one audio clip and 4 decoder ids."""
    ids = torch.tensor([list(range(5, 21))])
    if family != "whisper":
        return {"input_ids": ids}
    from transformers import AutoProcessor

    from fp8export.inputs.media import load_audio

    audio, rate = load_audio(media / "a0.wav", media, "a0.wav")
    feats = AutoProcessor.from_pretrained(src).feature_extractor(
        audio, sampling_rate=rate, return_tensors="pt")
    return {"input_features": feats["input_features"].to(torch.bfloat16),
            "decoder_input_ids": ids[:, :4]}


def logits(model, inputs: dict, seq: torch.Tensor) -> torch.Tensor:
    """The logits over ``seq`` (teacher-forced)."""
    with torch.no_grad():
        if "input_features" in inputs:
            return model(input_features=inputs["input_features"], decoder_input_ids=seq).logits
        return model(input_ids=seq).logits


def generate(model, inputs: dict, tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy generation of ``tokens`` new tokens (Whisper returns the new tokens only)."""
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False)


def compare(family: str, src: Path, fp8: Path, media: Path) -> dict:
    """Both models generate greedily; KL and top-1 over the bf16 model's sequence, and how
    many of the new tokens agree. Whisper: one forward call first (compressed-tensors
    decompresses on the model's first forward, and Whisper's generate calls its encoder
    before that: ``test_next_transformers.py`` pins the failure)."""
    ref, _ = load(src)
    model, info = load(fp8)
    inputs = prompt(family, src, media)
    if family == "whisper":
        logits(model, inputs, inputs["decoder_input_ids"])
    seq, ours = generate(ref, inputs), generate(model, inputs)
    kl, top1 = kl_top1(logits(ref, inputs, seq), logits(model, inputs, seq))
    new = (seq[:, -NEW_TOKENS:] == ours[:, -NEW_TOKENS:]) if seq.shape == ours.shape else None
    return {"kl_mean": kl, "top1": top1, "tokens": NEW_TOKENS,
            "same_tokens": int(new.sum()) if new is not None else 0,
            "missing": len(info["missing_keys"])}
