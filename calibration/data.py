"""Sample data for calibration and verification: read, tokenise, truncate, batch.

Formats (DESIGN.md, CLI contract):

- ``.txt``: one sample a line; blank lines are skipped.
- ``.jsonl``: one JSON object a line with a ``text`` field (optional ``label``: an int, or a
  string looked up in the checkpoint's ``config.json`` ``label2id``).
- ``.npz`` / ``.safetensors``: ``input_ids`` ``[N, T]`` (or ``[T]``), optionally
  ``attention_mask`` (same shape; positions where it is 0 are dropped) and ``labels``
  (``[N]`` per sample, or ``[N, T]`` per token).

Text is tokenised with the checkpoint's own tokenizer (``AutoTokenizer.from_pretrained(dir,
local_files_only=True)``) with its default special tokens, because that is the input the
model was trained on and will be served with. Samples are kept as token lists (no padding)
and padded per batch by :func:`iter_batches`, right-padded, in file order, so the same file
always gives the same batches (calibration is deterministic bit for bit).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export._progress import info
from fp8export.errors import Fp8ExportError, UsageError

if TYPE_CHECKING:
    import torch

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".npz", ".safetensors")
SUFFIXES = TEXT_SUFFIXES + TOKEN_SUFFIXES
IGNORE_INDEX = -100  # padding value of per-token labels: the index torch/HF losses ignore

_FORMATS_HINT = (
    "Give a .txt file (one sample a line), a .jsonl file (a 'text' field a line), or a "
    ".npz / .safetensors file holding 'input_ids' (and optionally 'attention_mask')."
)


@dataclass(frozen=True)
class Samples:
    """Tokenised samples of one data file, unpadded.

    ``input_ids[i]`` is sample ``i``'s tokens (already truncated); ``labels`` is None or one
    entry per sample: an ``int`` (sequence label) or a ``tuple[int, ...]`` aligned with the
    sample's tokens (per-token labels). ``pad_id`` pads batches (positions masked out anyway).
    """

    source: Path
    input_ids: tuple[tuple[int, ...], ...]
    pad_id: int
    labels: tuple[Any, ...] | None = None
    truncated: int = 0  # how many samples were cut to ``max_len``
    max_len: int | None = None  # the truncation length applied, if any

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.input_ids)


@dataclass(frozen=True)
class Batch:
    """One right-padded batch: ``input_ids`` / ``attention_mask`` int64 ``[B, T]``.

    ``labels`` is None, int64 ``[B]`` (sequence labels) or int64 ``[B, T]`` (per-token,
    padded with -100). ``indices`` are the samples' positions in the data file's order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None
    indices: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def load_samples(path: str | Path, tokenizer_dir: Path | None, *, max_samples: int | None = None,
                 seq_len: int | None = None, max_positions: int | None = None) -> Samples:
    """Read ``path`` into :class:`Samples`.

    Args:
        path: a ``.txt``, ``.jsonl``, ``.npz`` or ``.safetensors`` file.
        tokenizer_dir: folder with the checkpoint's tokenizer (needed for text formats; also
            where ``config.json`` with ``label2id`` is looked for).
        max_samples: keep the first N usable samples (file order).
        seq_len: requested maximum tokens per sample.
        max_positions: the model's maximum positions (``max_position_embeddings``); samples are
            truncated to ``min(seq_len, max_positions)`` with a notice.

    Raises:
        Fp8ExportError: missing / empty / unreadable / binary file, unknown suffix, text that
            tokenises to nothing, text without a tokenizer, token files without ``input_ids``.
    """
    p = Path(path)
    for name, value in (("--calib-samples", max_samples), ("--seq-len", seq_len)):
        if value is not None and int(value) < 1:
            raise Fp8ExportError(f"{name} must be >= 1, got {value}.")
    if not p.exists():
        raise Fp8ExportError(f"{p}: no such data file. {_FORMATS_HINT}")
    if p.is_dir():
        raise Fp8ExportError(f"{p}: is a folder, not a data file. {_FORMATS_HINT}")
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise Fp8ExportError(f"{p}: unknown data format {p.suffix!r}. {_FORMATS_HINT}")
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise Fp8ExportError(f"{p}: cannot read the data file ({exc.strerror}).") from exc
    if size == 0:
        raise Fp8ExportError(f"{p}: the data file is empty. {_FORMATS_HINT}")

    limits = [v for v in (seq_len, max_positions) if v is not None and v > 0]
    max_len = min(limits) if limits else None

    if suffix in TEXT_SUFFIXES:
        texts, raw_labels = _read_text(p, suffix, max_samples)
        ids, labels, pad_id = _tokenise(p, texts, raw_labels, tokenizer_dir, max_samples)
    else:
        ids, labels = _read_tokens(p, suffix, max_samples)
        pad_id = _pad_id_of(tokenizer_dir)

    truncated = 0
    if max_len is not None:
        out_ids = []
        for i, s in enumerate(ids):
            if len(s) > max_len:
                truncated += 1
                s = s[:max_len]
                if labels is not None and isinstance(labels[i], tuple):
                    labels[i] = labels[i][:max_len]
            out_ids.append(s)
        ids = out_ids
    if truncated:
        why = []
        if seq_len is not None and max_len == seq_len:
            why.append("--seq-len")
        if max_positions is not None and max_len == max_positions:
            why.append("the model's maximum positions")
        info(f"Note: {p}: {truncated} of {len(ids)} samples were longer than {max_len} tokens "
             f"({' and '.join(why)}) and were truncated.")
    return Samples(source=p, input_ids=tuple(tuple(s) for s in ids), pad_id=pad_id,
                   labels=tuple(labels) if labels is not None else None,
                   truncated=truncated, max_len=max_len)


def iter_batches(samples: Samples, batch_size: int) -> Iterator[Batch]:
    """Yield right-padded batches of ``batch_size`` samples in file order (the last may be short).

    Batches are padded to their own longest sample, not to ``seq_len``: padding costs compute
    and is masked out of every statistic anyway.
    """
    import torch

    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}.")
    n = len(samples)
    for start in range(0, n, batch_size):
        idx = tuple(range(start, min(start + batch_size, n)))
        rows = [samples.input_ids[i] for i in idx]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), samples.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r, dtype=torch.int64)
            mask[j, : len(r)] = 1
        labels = None
        if samples.labels is not None:
            lab = [samples.labels[i] for i in idx]
            if all(isinstance(v, tuple) for v in lab):
                labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
                for j, v in enumerate(lab):
                    labels[j, : len(v)] = torch.tensor(v, dtype=torch.int64)
            else:
                labels = torch.tensor([int(v) for v in lab], dtype=torch.int64)
        yield Batch(input_ids=ids, attention_mask=mask, labels=labels, indices=idx)


def num_batches(samples: Samples, batch_size: int) -> int:
    return (len(samples) + batch_size - 1) // batch_size


# --------------------------------------------------------------------------------------------
# readers


def _read_utf8_lines(p: Path) -> list[str]:
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise Fp8ExportError(f"{p}: cannot read the data file ({exc.strerror}).") from exc
    # A NUL byte never occurs in text; catching it first gives a clearer message than a
    # decode error deep in a binary blob (e.g. an .npz renamed to .txt).
    if b"\x00" in raw[:65536]:
        raise Fp8ExportError(
            f"{p}: looks like a binary file, not UTF-8 text. {_FORMATS_HINT}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Fp8ExportError(
            f"{p}: is not UTF-8 text (byte {exc.start}: {exc.reason}). Re-encode it as UTF-8."
        ) from exc
    return text.splitlines()


def _read_text(p: Path, suffix: str, max_samples: int | None):
    lines = _read_utf8_lines(p)
    texts: list[str] = []
    labels: list[Any] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if suffix == ".txt":
            texts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Fp8ExportError(
                f"{p}:{lineno}: not valid JSON ({exc.msg}). Each line of a .jsonl file must be "
                'one object like {"text": "..."}.') from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise Fp8ExportError(
                f"{p}:{lineno}: needs a string 'text' field, e.g. {{\"text\": \"...\"}}.")
        texts.append(obj["text"])
        labels.append(obj.get("label"))
    if not texts:
        raise Fp8ExportError(f"{p}: holds no samples (only blank lines). {_FORMATS_HINT}")
    has = [lab is not None for lab in labels]
    if any(has) and not all(has):
        first = has.index(False) if not all(has) else 0
        raise Fp8ExportError(
            f"{p}: some lines have a 'label' and some do not (sample {first + 1} has none). "
            "Give a label on every line or on none.")
    return texts, (labels if labels and all(has) else None)


def _load_tokenizer(p: Path, tokenizer_dir: Path | None):
    if tokenizer_dir is None:
        raise Fp8ExportError(
            f"{p}: text data needs the checkpoint's tokenizer, but no tokenizer folder is known "
            "(a single weights file was given). Pass a Hugging Face folder with tokenizer files, "
            "or give pre-tokenised .npz / .safetensors data with 'input_ids'.")
    tdir = Path(tokenizer_dir)
    if tdir.is_file():
        tdir = tdir.parent
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
             "vocab.txt", "spiece.model")
    if not any((tdir / n).exists() for n in names):
        raise Fp8ExportError(
            f"{p}: text data needs the checkpoint's tokenizer, but {tdir} has no tokenizer files "
            "(tokenizer.json / tokenizer_config.json / vocab). Save the tokenizer into the "
            "checkpoint folder (tokenizer.save_pretrained), or give pre-tokenised .npz / "
            ".safetensors data with 'input_ids'.")
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(tdir), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...)
        raise Fp8ExportError(
            f"{tdir}: cannot load the tokenizer ({type(exc).__name__}: {exc}). Check the "
            "tokenizer files in the checkpoint folder.") from exc


def _tokenise(p: Path, texts: list[str], raw_labels: list[Any] | None,
              tokenizer_dir: Path | None, max_samples: int | None):
    tok = _load_tokenizer(p, tokenizer_dir)
    label2id = _label2id(tokenizer_dir) if raw_labels is not None else {}
    try:
        n_special = int(tok.num_special_tokens_to_add(pair=False))
    except Exception:  # slow tokenizers without the method: count nothing as special
        n_special = 0
    ids: list[list[int]] = []
    labels: list[Any] | None = [] if raw_labels is not None else None
    skipped = 0
    for i, text in enumerate(texts):
        if max_samples is not None and len(ids) >= max_samples:
            break
        enc = tok(text, add_special_tokens=True, truncation=False)["input_ids"]
        # A line that yields only the special tokens (BOS/CLS/SEP) carries no text for the
        # statistics: skip it, and fail below if that leaves nothing.
        if len(enc) <= n_special:
            skipped += 1
            continue
        ids.append([int(t) for t in enc])
        if labels is not None:
            labels.append(_label_value(p, raw_labels[i], label2id, i))
    if not ids:
        raise Fp8ExportError(
            f"{p}: the text tokenises to nothing with the tokenizer in {tokenizer_dir} "
            f"({len(texts)} lines, none giving a non-special token). Check the file's "
            "encoding and that it is the right tokenizer.")
    if skipped:
        info(f"Note: {p}: {skipped} lines tokenised to nothing and were skipped.")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ids, labels, int(pad) if pad is not None else 0


def _label2id(tokenizer_dir: Path | None) -> dict[str, int]:
    if tokenizer_dir is None:
        return {}
    cfg = Path(tokenizer_dir) / "config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in (data.get("label2id") or {}).items()}


def _label_value(p: Path, value: Any, label2id: dict[str, int], i: int) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value in label2id:
            return label2id[value]
        if value.lstrip("-").isdigit():
            return int(value)
        raise Fp8ExportError(
            f"{p}: sample {i + 1} has label {value!r}, which the checkpoint's config.json "
            f"label2id does not name (known: {sorted(label2id) or 'none'}). Use integer labels.")
    raise Fp8ExportError(f"{p}: sample {i + 1} has label {value!r}; use an int or a string.")


def _read_tokens(p: Path, suffix: str, max_samples: int | None):
    import numpy as np

    try:
        if suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:  # never unpickle user data
                arrays = {k: z[k] for k in z.files}
        else:
            from safetensors.numpy import load_file

            arrays = load_file(str(p))
    except Exception as exc:  # zipfile.BadZipFile, SafetensorError, ValueError, OSError
        raise Fp8ExportError(
            f"{p}: cannot read it as {suffix} ({type(exc).__name__}: {exc}). "
            f"{_FORMATS_HINT}") from exc
    if "input_ids" not in arrays:
        raise Fp8ExportError(
            f"{p}: has no 'input_ids' array (found: {sorted(arrays) or 'nothing'}). Save the "
            "token ids as 'input_ids' [N, T] (and optionally 'attention_mask').")
    ids = np.asarray(arrays["input_ids"])
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise Fp8ExportError(
            f"{p}: 'input_ids' has shape {ids.shape}; expected [N, T] with N, T > 0.")
    if not np.issubdtype(ids.dtype, np.integer):
        raise Fp8ExportError(f"{p}: 'input_ids' has dtype {ids.dtype}; token ids must be integers.")
    mask = arrays.get("attention_mask")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.ndim == 1:
            mask = mask[None, :]
        if mask.shape != ids.shape:
            raise Fp8ExportError(
                f"{p}: 'attention_mask' has shape {mask.shape} but 'input_ids' has {ids.shape}.")
    labels_arr = arrays.get("labels")
    if labels_arr is not None:
        labels_arr = np.asarray(labels_arr)
        if labels_arr.ndim == 1 and ids.shape[0] == 1 and labels_arr.shape[0] == ids.shape[1]:
            labels_arr = labels_arr[None, :]  # one sample given as [T] with per-token labels
        if labels_arr.shape not in ((ids.shape[0],), ids.shape):
            raise Fp8ExportError(
                f"{p}: 'labels' has shape {labels_arr.shape}; expected [N] = [{ids.shape[0]}] "
                f"or the shape of 'input_ids' {ids.shape}.")
    out: list[list[int]] = []
    labels: list[Any] | None = [] if labels_arr is not None else None
    skipped = 0
    for i in range(ids.shape[0]):
        if max_samples is not None and len(out) >= max_samples:
            break
        keep = mask[i] != 0 if mask is not None else np.ones(ids.shape[1], dtype=bool)
        row = ids[i][keep]
        if row.size == 0:
            skipped += 1
            continue
        out.append([int(t) for t in row])
        if labels is not None:
            if labels_arr.ndim == 1:
                labels.append(int(labels_arr[i]))
            else:
                labels.append(tuple(int(t) for t in labels_arr[i][keep]))
    if not out:
        raise Fp8ExportError(
            f"{p}: every sample's attention_mask is all zeros; there are no tokens to use.")
    if skipped:
        info(f"Note: {p}: {skipped} samples with an all-zero attention_mask were skipped.")
    return out, labels


def _pad_id_of(tokenizer_dir: Path | None) -> int:
    """The pad id from the checkpoint's config (0 if none): padded positions are masked anyway."""
    if tokenizer_dir is None:
        return 0
    for name in ("tokenizer_config.json", "config.json"):
        try:
            data = json.loads((Path(tokenizer_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key in ("pad_token_id", "eos_token_id"):
            v = data.get(key)
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int):
                return v
    return 0


def as_samples(token_lists: Sequence[Sequence[int]], pad_id: int = 0,
               source: str | Path = "<memory>") -> Samples:
    """Build :class:`Samples` from token lists already in memory (tests, library users)."""
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise Fp8ExportError(f"{source}: samples must be non-empty token lists.")
    return Samples(source=Path(str(source)), input_ids=tuple(tuple(int(x) for x in t)
                                                              for t in token_lists),
                   pad_id=int(pad_id))
