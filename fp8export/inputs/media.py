"""Multimodal samples: JSONL lines with text plus an image or audio file, encoded by the
model's own processor (``AutoProcessor``) into the tensors its forward takes.

A line is ``{"text": "...", "image": "cat.png"}`` or ``{"text": "...", "audio": "a.wav"}``
(``text`` optional with media: the prompt, or Whisper's transcript that the decoder reads).
Media paths are relative to the data file's folder and must stay inside it (the guarded
opener refuses anything else). Every file is bounded before it is decoded:

* bytes: at most :data:`MAX_IMAGE_BYTES` / :data:`MAX_AUDIO_BYTES` (checked on the descriptor,
  and reads stop there);
* images: Pillow reads only the header first; more than :data:`MAX_IMAGE_PIXELS` pixels (a
  decompression bomb: a few KB of PNG that decodes to gigabytes) is refused before any pixel
  is decoded; only PNG, JPEG, WebP, GIF and BMP decoders are allowed; animations give their
  first frame;
* audio: soundfile reads the header, refuses more than :data:`MAX_AUDIO_SECONDS` or
  :data:`MAX_AUDIO_CHANNELS`, and reads at most that many frames whatever the header says.

Pillow comes with the core install (matplotlib depends on it); soundfile is the ``audio``
extra, named in the error when missing. The processor is loaded from a private copy of its
files made through the guarded opener (:func:`open_processor`) and runs in this process.
Each sample is its own batch (images give different numbers of tokens and patches); the
tensors the processor makes besides ``input_ids`` / ``attention_mask`` travel in
:attr:`Samples.extras`.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, FileKind, MiB, parse_json, read_input

IMAGE = FileKind("image file", 64 * MiB)
AUDIO = FileKind("audio file", 256 * MiB)
MAX_IMAGE_BYTES = IMAGE.max_bytes
MAX_AUDIO_BYTES = AUDIO.max_bytes
MAX_IMAGE_PIXELS = 40_000_000  # ~6300 x 6300: larger than any processor resizes from
MAX_AUDIO_SECONDS = 600.0
MAX_AUDIO_CHANNELS = 8
MAX_SAMPLE_RATE = 384_000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MEDIA_KEYS = ("image", "audio")
# what processors read besides the tokenizer's files (copied as the tokenizer's are)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "chat_template.json", "chat_template.jinja")
WHISPER_RATE = 16_000


def media_fields(obj: dict[str, Any]) -> list[str]:
    """The media keys a JSONL record uses."""
    return [k for k in MEDIA_KEYS if obj.get(k) is not None]


def _media_path(data_file: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise Fp8ExportError(f"{where}: a media path must be a non-empty string, relative to "
                             f"the data file's folder {data_file.parent}.")
    rel = PurePosixPath(value)
    if rel.is_absolute() or ".." in rel.parts:
        raise Fp8ExportError(f"{where}: media path {value[:200]!r} leaves the data file's "
                             f"folder; give a path relative to {data_file.parent}, inside it.")
    return data_file.parent / rel


def load_image(path: Path, root: Path, where: str):
    """An RGB ``PIL.Image`` of ``path``, refused before decoding when it is too large."""
    from PIL import Image

    raw = read_input(path, IMAGE, root=root)
    try:
        img = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)  # header only
    except Image.DecompressionBombError as exc:
        raise _bomb(where, path, str(exc)) from None
    except Exception as exc:  # unidentified or truncated image: Pillow raises several types
        raise Fp8ExportError(f"{where}: {path.name} is not a readable image "
                             f"({', '.join(IMAGE_FORMATS)}): {str(exc)[:200]}") from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise _bomb(where, path, f"{width} x {height} pixels")
    try:
        img.seek(0)
        return img.convert("RGB")
    except Exception as exc:
        raise Fp8ExportError(f"{where}: {path.name} could not be decoded as "
                             f"{img.format}: {str(exc)[:200]}") from None


def _bomb(where: str, path: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(
        f"{where}: {path.name} is refused before decoding ({what}; at most "
        f"{MAX_IMAGE_PIXELS:,} pixels): a decompression bomb or an image far larger than any "
        "processor uses. Resize it (e.g. to 1024 px on the long side).")


def load_audio(path: Path, root: Path, where: str):
    """``(mono float32 samples, sample rate)`` of ``path``, bounded before decoding."""
    try:
        import soundfile as sf
    except ImportError:
        raise Fp8ExportError(f"{where}: reading audio needs soundfile: pip install "
                             "'fp8export[audio]' (or pip install soundfile).") from None
    raw = read_input(path, AUDIO, root=root)
    try:
        meta = sf.info(io.BytesIO(raw))
    except Exception as exc:
        raise Fp8ExportError(f"{where}: {path.name} is not a readable audio file (WAV, FLAC, "
                             f"OGG): {str(exc)[:200]}") from None
    rate, channels = int(meta.samplerate), int(meta.channels)
    if not 0 < rate <= MAX_SAMPLE_RATE or not 0 < channels <= MAX_AUDIO_CHANNELS:
        raise Fp8ExportError(f"{where}: {path.name} declares {rate} Hz and {channels} "
                             f"channel(s); at most {MAX_SAMPLE_RATE} Hz and "
                             f"{MAX_AUDIO_CHANNELS} channels are read.")
    if meta.frames / rate > MAX_AUDIO_SECONDS:
        raise Fp8ExportError(f"{where}: {path.name} is {meta.frames / rate:.0f} s long; at most "
                             f"{MAX_AUDIO_SECONDS:.0f} s per sample are read. Cut it into "
                             "shorter clips.")
    limit = int(MAX_AUDIO_SECONDS * rate) + 1  # whatever the header claims
    try:
        data, rate = sf.read(io.BytesIO(raw), frames=limit, dtype="float32", always_2d=True)
    except Exception as exc:
        raise Fp8ExportError(f"{where}: {path.name} could not be decoded: "
                             f"{str(exc)[:200]}") from None
    if len(data) >= limit:
        raise Fp8ExportError(f"{where}: {path.name} holds more than {MAX_AUDIO_SECONDS:.0f} s "
                             "of audio (more than its header says). Cut it into shorter clips.")
    return data.mean(axis=1), int(rate)


def _resample(x, rate: int, target: int):
    """Linear resampling (speech processors expect one rate; WAV files come in many)."""
    import numpy as np

    if rate == target or len(x) == 0:
        return x
    n = max(1, int(round(len(x) * target / rate)))
    return np.interp(np.linspace(0, len(x) - 1, n), np.arange(len(x)), x).astype("float32")


def open_processor(model_dir: Path):
    """The model's own processor (``AutoProcessor``), loaded as the tokenizer is: from a
    private copy of its files made through the guarded opener (regular files inside the model
    folder, size capped, JSON limits; the tokenizer checked as :mod:`~fp8export.inputs.
    tokenizer` checks it; keys that name code or other files dropped), local files only, no
    remote code. It runs in this process; the media it reads are bounded before decoding."""
    import tempfile

    from transformers import AutoProcessor

    from fp8export.inputs.tokenizer import private_copy

    model_dir = Path(model_dir)
    try:
        with tempfile.TemporaryDirectory(prefix="fp8export-processor-") as tmp:
            private_copy(model_dir, Path(tmp))
            for name in PROCESSOR_FILES:
                _copy_processor_file(model_dir, Path(tmp), name)
            processor = AutoProcessor.from_pretrained(tmp, local_files_only=True,
                                                      trust_remote_code=False)
        if not any(hasattr(processor, a) for a in ("image_processor", "feature_extractor")):
            # AutoProcessor falls back to the tokenizer alone, which drops the media silently
            raise ValueError("no image processor or feature extractor in the folder")
        return processor
    except Fp8ExportError:
        raise
    except Exception as exc:
        raise Fp8ExportError(
            f"{model_dir}: images/audio in the data need the model's processor, and it cannot "
            f"be loaded ({type(exc).__name__}: {str(exc)[:200]}). Put the processor's files "
            "(preprocessor_config.json, processor_config.json) beside the model, or use "
            "text-only data for the language tower.") from None


def _copy_processor_file(folder: Path, private: Path, name: str) -> None:
    src = folder / name
    if not os.path.lexists(src):
        return
    raw = read_input(src, CONFIG, root=folder)
    if name.endswith(".json"):
        doc = parse_json(raw, src, name)
        if not isinstance(doc, dict):
            raise Fp8ExportError(f"{src}: must hold a JSON object. Save the processor again "
                                 "(processor.save_pretrained).")
        doc = {k: v for k, v in doc.items()
               if k not in ("auto_map", "name_or_path", "_name_or_path")
               and not k.endswith(("_file", "_files"))}
        raw = json.dumps(doc).encode()
    (private / name).write_bytes(raw)


def _prompt(processor, text: str) -> str:
    """``text`` with the processor's image placeholder where the model expects one."""
    token = getattr(processor, "image_token", None) or "<image>"
    if token in text:
        return text
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": text}]}]
        return processor.apply_chat_template(messages, add_generation_prompt=False,
                                             tokenize=False)
    return f"{token}{text}"


def encode(processor, record: dict[str, Any], data_file: Path, where: str,
           max_len: int | None) -> tuple[tuple[int, ...], dict[str, Any], str]:
    """One record through the processor: ``(input ids, extra tensors, kind)``."""
    import torch

    text = record.get("text") or ""
    if not isinstance(text, str):
        raise Fp8ExportError(f"{where}: 'text' must be a string.")
    root = data_file.parent
    if record.get("image") is not None:
        img = load_image(_media_path(data_file, record["image"], where), root, where)
        out = processor(text=[_prompt(processor, text)], images=[img], return_tensors="pt")
        kind = "image"
    else:
        audio, rate = load_audio(_media_path(data_file, record["audio"], where), root, where)
        extractor = getattr(processor, "feature_extractor", processor)
        target = int(getattr(extractor, "sampling_rate", None) or WHISPER_RATE)
        feats = extractor(_resample(audio, rate, target), sampling_rate=target,
                          return_tensors="pt")
        tok = getattr(processor, "tokenizer", None)
        if tok is None:
            raise Fp8ExportError(f"{where}: the model's processor has no tokenizer for the "
                                 "transcript.")
        ids = tok(text or "", return_tensors="pt")["input_ids"]
        out = {**{k: v for k, v in feats.items() if k == "input_features"}, "input_ids": ids}
        kind = "audio"
    ids = out["input_ids"][0].tolist()
    if max_len is not None and len(ids) > max_len:
        if kind == "image":
            raise Fp8ExportError(f"{where}: the image and text make {len(ids)} tokens, more "
                                 f"than --seq-len {max_len}; image tokens cannot be cut. Raise "
                                 "--seq-len or use smaller images.")
        ids = ids[:max_len]
    extras = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")
              and isinstance(v, torch.Tensor)}
    return tuple(ids), extras, kind


def read_records(p: Path, lines, model_dir: Path | None, *, max_samples: int | None,
                 max_len: int | None, check_ids) -> tuple[list, list, dict[str, Any]]:
    """The JSONL ``lines`` (``(line number, record)``) of a file that names media:
    ``(token id lists, extras per sample, what was read)``; ``check_ids(i, lo, hi)`` bounds the
    ids by the model's vocabulary."""
    if model_dir is None:
        raise Fp8ExportError(f"{p}: images/audio need the model's processor, and no model "
                             "folder is known here.")
    processor = open_processor(model_dir)
    tok = getattr(processor, "tokenizer", processor)
    ids_out: list = []
    extras_out: list = []
    counts = {"image": 0, "audio": 0, "text": 0}
    for lineno, record in lines:
        if max_samples is not None and len(ids_out) >= max_samples:
            break
        where = f"{p}:{lineno}"
        if media_fields(record):
            if len(media_fields(record)) > 1:
                raise Fp8ExportError(f"{where}: give one of 'image' or 'audio' per line.")
            ids, extras, kind = encode(processor, record, p, where, max_len)
        else:
            text = record.get("text")
            if not isinstance(text, str) or not text.strip():
                raise Fp8ExportError(f"{where}: needs a string 'text' field, or an 'image' / "
                                     "'audio' path.")
            ids = tuple(tok(text)["input_ids"][:max_len] if max_len else tok(text)["input_ids"])
            extras, kind = {}, "text"
        if not ids:
            raise Fp8ExportError(f"{where}: the sample encodes to no tokens.")
        check_ids(len(ids_out), min(ids), max(ids))
        counts[kind] += 1
        ids_out.append(ids)
        extras_out.append(extras)
    info = {"processor": type(processor).__name__, "images": counts["image"],
            "audio": counts["audio"], "text_only": counts["text"]}
    return ids_out, extras_out, info
