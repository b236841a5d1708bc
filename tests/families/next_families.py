"""Tiny random models of the newer families: vision-language models, DeepSeek-V3, gpt-oss,
hybrid decoders and Whisper, built and saved by transformers itself (``save_next``).

Same rules as ``model_families.py``: ``AutoConfig.for_model`` + the architecture's class with
random weights (seeded), ``save_pretrained`` in bf16, the sample tokenizer beside it. Language
towers: hidden 64, 2 layers, 4 heads of 16 (K and N of every FP8 GEMM multiples of 16); vision
and audio towers: hidden 32, 1-2 layers. Each MoE has 4 experts (top 2) with a router scaled
as in ``model_families.ROUTER_GAIN``. Image (audio) token ids are ids of the sample
tokenizer's vocabulary that text never produces.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from model_families import ROUTER_GAIN, TOKENIZER, TOKENIZER_FILES, VOCAB

_IDS = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_TEXT = {**_IDS, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 256}
IMAGE_TOKEN = VOCAB - 2  # never produced by the sample tokenizer from text
_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "out_hidden_size": 64}
_QWEN_VL_IDS = {"image_token_id": IMAGE_TOKEN, "video_token_id": IMAGE_TOKEN - 1,
                "vision_start_token_id": IMAGE_TOKEN - 2, "vision_end_token_id": IMAGE_TOKEN - 3}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

NEXT_FAMILIES: dict[str, tuple[str, str, dict]] = {
    # name: (model_type, architecture, config values)
    "qwen2.5-vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", {
        **_QWEN_VL_IDS,
        "text_config": {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}},
        "vision_config": {**_QWEN_VISION, "window_size": 32, "fullatt_block_indexes": [0]}}),
    "qwen3-vl": ("qwen3_vl", "Qwen3VLForConditionalGeneration", {
        **_QWEN_VL_IDS,
        "text_config": {**_TEXT, "rope_scaling": {"rope_type": "default",
                                                  "mrope_section": [2, 2, 4]}},
        "vision_config": {**_QWEN_VISION, "num_position_embeddings": 16,
                          "deepstack_visual_indexes": [0]}}),
    "qwen3-vl-moe": ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", {
        **_QWEN_VL_IDS,
        "text_config": {**_TEXT, **_MOE, "num_experts": 4, "decoder_sparse_step": 1,
                        "mlp_only_layers": [], "tie_word_embeddings": False,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 2, 4]}},
        "vision_config": {**_QWEN_VISION, "num_position_embeddings": 16,
                          "deepstack_visual_indexes": [0]}}),
    "gemma3-vl": ("gemma3", "Gemma3ForConditionalGeneration", {
        "image_token_index": IMAGE_TOKEN, "boi_token_index": IMAGE_TOKEN - 1,
        "eoi_token_index": IMAGE_TOKEN - 2, "mm_tokens_per_image": 4,
        "text_config": {**_TEXT, "sliding_window": 64, "query_pre_attn_scalar": 16},
        "vision_config": {**_SIGLIP, "vision_use_head": False}}),
    "mllama": ("mllama", "MllamaForConditionalGeneration", {
        "image_token_index": IMAGE_TOKEN,
        "text_config": {**{k: v for k, v in _TEXT.items() if k != "head_dim"},
                        "num_hidden_layers": 3, "cross_attention_layers": [1]},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_global_layers": 1, "attention_heads": 2, "image_size": 32,
                          "patch_size": 8, "vision_output_dim": 64,
                          "intermediate_layers_indices": [0], "max_num_tiles": 1,
                          "supported_aspect_ratios": [[1, 1]]}}),
    "llava": ("llava", "LlavaForConditionalGeneration", {  # with a processor: "<image>" added
        "image_token_index": VOCAB, "image_seq_length": 16,
        "text_config": {**_TEXT, "vocab_size": VOCAB + 1, "model_type": "llama"},
        "vision_config": {**_SIGLIP, "model_type": "clip_vision_model", "projection_dim": 32}}),
    "idefics3": ("idefics3", "Idefics3ForConditionalGeneration", {
        "image_token_id": IMAGE_TOKEN, "scale_factor": 2,
        "text_config": {**_TEXT, "model_type": "llama"},
        "vision_config": _SIGLIP}),
    "llama4": ("llama4", "Llama4ForConditionalGeneration", {
        "image_token_index": IMAGE_TOKEN, "boi_token_index": IMAGE_TOKEN - 1,
        "eoi_token_index": IMAGE_TOKEN - 2,
        "text_config": {**_TEXT, "num_local_experts": 4, "num_experts_per_tok": 1,
                        "intermediate_size": 32, "intermediate_size_mlp": 128,
                        "interleave_moe_layer_step": 2, "attention_chunk_size": 64,
                        "no_rope_layer_interval": 2},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                          "vision_output_dim": 64, "projector_input_dim": 64,
                          "projector_output_dim": 64, "pixel_shuffle_ratio": 0.5}}),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3ForCausalLM", {
        **{k: v for k, v in _TEXT.items() if k != "head_dim"}, **_MOE, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "rope_interleave": True}),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM", {
        **_TEXT, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3-next": ("qwen3_next", "Qwen3NextForCausalLM", {
        **_TEXT, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}),
    "jamba": ("jamba", "JambaForCausalLM", {
        **{k: v for k, v in _TEXT.items() if k != "head_dim"}, "num_experts": 4,
        "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
        "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 16, "use_mamba_kernels": False}),
    "whisper": ("whisper", "WhisperForConditionalGeneration", {
        **_IDS, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128, "num_mel_bins": 16, "max_source_positions": 50,
        "max_target_positions": 256, "decoder_start_token_id": 1,
        "begin_suppress_tokens": None, "suppress_tokens": None}),
}
VLM_FAMILIES = ("qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "gemma3-vl", "mllama", "llava",
                "idefics3", "llama4")
NEXT_MOE = ("qwen3-vl-moe", "llama4", "deepseek-v3", "gpt-oss", "qwen3-next", "jamba")


def build_next(name: str, seed: int = 0):
    """The random bf16 model of family ``name`` (not saved)."""
    import torch
    import transformers

    model_type, arch, values = NEXT_FAMILIES[name]
    config = transformers.AutoConfig.for_model(model_type, **values)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    text = getattr(config, "text_config", config)
    with torch.no_grad():  # routers pick experts by a margin (model_families.ROUTER_GAIN)
        for pname, p in model.named_parameters():
            router = pname.endswith(("mlp.gate.weight", "mlp.router.weight",
                                     "feed_forward.router.weight", "router.weight"))
            if router and p.dim() == 2 and p.shape[0] != text.hidden_size:
                p.mul_(ROUTER_GAIN)
    return model


def save_next(name: str, folder: Path, seed: int = 0) -> Path:
    """Build family ``name`` with random weights and save it (bf16) with the sample tokenizer
    (LLaVA and Whisper: with a processor, for image / audio data)."""
    folder = Path(folder)
    build_next(name, seed).save_pretrained(folder)
    if name in PROCESSORS:
        PROCESSORS[name]().save_pretrained(folder)
    else:
        for f in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER / f, folder / f)
    return folder


def _llava_processor():
    """CLIP preprocessing to 32 x 32 (16 patches of 8: the tower's), ``<image>`` as token
    ``VOCAB``. Pillow-only classes (torchvision is not installed)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == VOCAB
    image = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=8,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def _whisper_processor():
    """16 mel bins over 1 s windows (100 frames: the encoder's 50 positions after its stride)."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperProcessor

    features = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160,
                                       chunk_length=1, n_fft=400)
    return WhisperProcessor(feature_extractor=features,
                            tokenizer=AutoTokenizer.from_pretrained(str(TOKENIZER)))


PROCESSORS = {"llava": _llava_processor, "whisper": _whisper_processor}


def write_media(folder: Path, n: int = 12) -> Path:
    """Images and audio clips (seeded noise and tones) with JSONL files naming them."""
    import json

    import numpy as np
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = (TOKENIZER.parent / "data" / "calib.txt").read_text(encoding="utf-8").splitlines()
    images, audio = [], []
    t = np.arange(int(16000 * 0.8)) / 16000
    for i in range(n):
        pixels = (rng.random((24 + 4 * i, 40, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        tone = 0.3 * np.sin(2 * np.pi * (200 + 50 * i) * t) + 0.05 * rng.standard_normal(len(t))
        sf.write(folder / f"a{i}.wav", tone.astype("float32"), 16000)
        images.append({"text": lines[i][:80], "image": f"img{i}.png"})
        audio.append({"text": lines[i][:80], "audio": f"a{i}.wav"})
    images.append({"text": lines[n]})
    for name, records in (("images.jsonl", images), ("audio.jsonl", audio)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder
