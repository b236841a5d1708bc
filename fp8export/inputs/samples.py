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

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from fp8export._progress import info
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.io.guarded import CONFIG, DATA, open_input, parse_json, read_json_object
from fp8export.io.safezip import check_ratio

if TYPE_CHECKING:
    import torch

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".npz", ".safetensors")
SUFFIXES = TEXT_SUFFIXES + TOKEN_SUFFIXES
IGNORE_INDEX = -100  # padding value of per-token labels: the index torch/HF losses ignore
# Bounds on what a data file may ask of us. A sample line is truncated to the model's maximum
# positions anyway; 1 MiB of text is ~250k tokens (the tokenizer itself aborts the process on a
# line of a few hundred MB). Token files: rows and row length within the same spirit.
MAX_LINE_BYTES = 1 << 20
MAX_SAMPLES = 1_000_000
MAX_TOKENS_PER_SAMPLE = 1 << 20
MAX_LABEL = (1 << 31) - 1
# Token data read from a token file, at most: 1 GiB is 134 M int64 ids, thousands of times what
# calibration or verification uses.
MAX_TOKEN_BYTES = 1 << 30

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
    # per sample, the tensors the model's processor made besides the tokens (pixel_values,
    # image_grid_thw, input_features...: ``fp8export.inputs.media``); None for token data
    extras: tuple[dict[str, Any], ...] | None = None
    media: dict[str, Any] | None = None  # what the media data held (for reports)

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
    extras: dict[str, Any] | None = None  # the sample's media tensors (one-sample batches)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def check_data_file(path: str | Path) -> Path:
    """Refuse a data file for what can be seen without reading it: missing, a folder, an
    unknown format, not a regular file, over the size cap, or empty. Commands call this before
    any hashing or model loading, so a typo costs nothing; :func:`load_samples` calls it too."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise Fp8ExportError(f"{p}: no such data file. {_FORMATS_HINT}")
    if p.is_dir():
        raise Fp8ExportError(f"{p}: is a folder, not a data file. {_FORMATS_HINT}")
    if p.suffix.lower() not in SUFFIXES:
        raise Fp8ExportError(f"{p}: unknown data format {p.suffix!r}. {_FORMATS_HINT}")
    with open_input(p, DATA) as f:  # a regular file within the size cap (no FIFO, no device)
        if os.fstat(f.fileno()).st_size == 0:
            raise Fp8ExportError(f"{p}: the data file is empty. {_FORMATS_HINT}")
    return p


def media_kinds(path: str | Path) -> list[str]:
    """The media (``image``, ``audio``) the lines of a .jsonl data file name; none for the
    other formats (a malformed line is :func:`load_samples`' to report)."""
    from fp8export.inputs.media import media_fields

    p = check_data_file(path)
    if p.suffix.lower() != ".jsonl":
        return []
    with open_input(p, DATA) as f:
        records = _media_lines(p, f) or []
    return sorted({k for _, obj in records for k in media_fields(obj)})


def load_samples(path: str | Path, tokenizer_dir: Path | None, *, max_samples: int | None = None,
                 seq_len: int | None = None, max_positions: int | None = None,
                 vocab_size: int | None = None, num_labels: int | None = None,
                 tokenizer=None) -> Samples:
    """Read ``path`` into :class:`Samples`.

    Args:
        path: a ``.txt``, ``.jsonl``, ``.npz`` or ``.safetensors`` file.
        tokenizer_dir: folder with the checkpoint's tokenizer (needed for text formats; also
            where ``config.json`` with ``label2id`` is looked for).
        max_samples: keep the first N usable samples (file order).
        seq_len: requested maximum tokens per sample.
        max_positions: the model's maximum positions (``max_position_embeddings``); samples are
            truncated to ``min(seq_len, max_positions)`` with a notice.
        vocab_size: the model's vocabulary; every token id must be in ``[0, vocab_size)``.
        num_labels: classes of a sequence classifier; sequence labels must be below it.
        tokenizer: an open :func:`~fp8export.inputs.tokenizer.open_tokenizer` of
            ``tokenizer_dir`` to use (and leave open); by default one is opened and closed here.

    Raises:
        Fp8ExportError: missing / empty / unreadable / binary file, unknown suffix, text that
            tokenises to nothing, text without a tokenizer, token files without ``input_ids``,
            a line longer than :data:`MAX_LINE_BYTES`, more than :data:`MAX_SAMPLES` samples,
            token ids outside the vocabulary, labels out of range.
    """
    p = Path(path)
    for name, value in (("--calib-samples", max_samples), ("--seq-len", seq_len)):
        if value is not None and int(value) < 1:
            raise Fp8ExportError(f"{name} must be >= 1, got {value}.")
    check_data_file(p)
    suffix = p.suffix.lower()

    limits = [v for v in (seq_len, max_positions) if v is not None and v > 0]
    max_len = min(limits) if limits else None
    bounds = _Bounds(p, vocab_size, num_labels)

    with open_input(p, DATA) as f:  # a regular file within the size cap (no FIFO, no device)
        if os.fstat(f.fileno()).st_size == 0:
            raise Fp8ExportError(f"{p}: the data file is empty. {_FORMATS_HINT}")
        media = _media_lines(p, f) if suffix == ".jsonl" else None
        if media is not None:
            from fp8export.inputs.media import read_records

            ids, extras, media_info = read_records(p, media, tokenizer_dir,
                                                   max_samples=max_samples, max_len=max_len,
                                                   check_ids=bounds.check_ids)
            return Samples(source=p, input_ids=tuple(ids), pad_id=_pad_id_of(tokenizer_dir,
                                                                             vocab_size),
                           max_len=max_len, extras=tuple(extras), media=media_info)
        if suffix in TEXT_SUFFIXES:
            ids, labels, pad_id = _tokenise(p, _text_samples(p, f, suffix), tokenizer_dir,
                                            max_samples, bounds, tokenizer)
        else:
            ids, labels = _read_tokens(p, f, suffix, max_samples, bounds)
            pad_id = _pad_id_of(tokenizer_dir, vocab_size)

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
    if samples.extras is not None:  # media: each sample its own batch (own patch count)
        batch_size = 1
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
        yield Batch(input_ids=ids, attention_mask=mask, labels=labels, indices=idx,
                    extras=samples.extras[start] if samples.extras is not None else None)


def num_batches(samples: Samples, batch_size: int) -> int:
    if samples.extras is not None:
        return len(samples)
    return (len(samples) + batch_size - 1) // batch_size


# --------------------------------------------------------------------------------------------
# readers


@dataclass(frozen=True)
class _Bounds:
    """What a data file's numbers must stay within (token ids, labels, sample count)."""

    path: Path
    vocab_size: int | None
    num_labels: int | None

    def check_count(self, n: int) -> None:
        if n > MAX_SAMPLES:
            raise Fp8ExportError(
                f"{self.path}: more than {MAX_SAMPLES} samples; pass --samples / --calib-samples "
                "to use the first N, or split the file.")

    def check_ids(self, i: int, lo: int, hi: int, *, text: bool = False) -> None:
        top = self.vocab_size if self.vocab_size else MAX_LABEL + 1
        if lo < 0 or hi >= top:
            bad = lo if lo < 0 else hi
            why = (" The tokenizer does not match the model." if text else
                   " The data was tokenised for another model.")
            raise Fp8ExportError(
                f"{self.path}: sample {i + 1} has token id {bad}, outside the model's "
                f"vocabulary [0, {top}).{why}")

    def check_label(self, i: int, value: int) -> int:
        top = self.num_labels if self.num_labels else MAX_LABEL + 1
        if not 0 <= value < top:
            raise Fp8ExportError(
                f"{self.path}: sample {i + 1} has label {value}, outside [0, {top})"
                + (" (the model's classes)" if self.num_labels else "") + ".")
        return value

    def check_token_labels(self, i: int, row) -> None:
        top = self.vocab_size if self.vocab_size else MAX_LABEL + 1
        bad = [int(v) for v in row if not (v == IGNORE_INDEX or 0 <= v < top)]
        if bad:
            raise Fp8ExportError(
                f"{self.path}: sample {i + 1} has per-token label {bad[0]}, neither "
                f"{IGNORE_INDEX} (ignored) nor a token id in [0, {top}).")


def _lines(p: Path, f: IO[bytes]) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file, read one bounded line at a time."""
    offset = 0
    lineno = 0
    while True:
        try:
            raw = f.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            raise Fp8ExportError(f"{p}: cannot read the data file ({exc.strerror}).") from exc
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise Fp8ExportError(
                f"{p}:{lineno}: the line is longer than {MAX_LINE_BYTES} bytes. A sample is one "
                "line of at most that much text; split or shorten it.")
        # A NUL byte never occurs in text; catching it first gives a clearer message than a
        # decode error deep in a binary blob (e.g. an .npz renamed to .txt).
        if b"\x00" in raw:
            raise Fp8ExportError(
                f"{p}: looks like a binary file, not UTF-8 text. {_FORMATS_HINT}")
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise Fp8ExportError(
                f"{p}: is not UTF-8 text (byte {offset + exc.start}: {exc.reason}). Re-encode "
                "it as UTF-8.") from exc
        offset += len(raw)
        for piece in text.splitlines():
            yield lineno, piece


def _text_samples(p: Path, f: IO[bytes], suffix: str) -> Iterator[tuple[str, Any]]:
    """``(text, label)`` of every non-blank line (label None for .txt and unlabelled .jsonl)."""
    for lineno, line in _lines(p, f):
        if not line.strip():
            continue
        if suffix == ".txt":
            yield line, None
            continue
        try:
            obj = parse_json(line, f"{p}:{lineno}", "the line")
        except Fp8ExportError as exc:
            raise Fp8ExportError(
                f"{exc} Each line of a .jsonl file must be one object like "
                '{"text": "..."}.') from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise Fp8ExportError(
                f"{p}:{lineno}: needs a string 'text' field, e.g. {{\"text\": \"...\"}}.")
        _check_unicode(obj["text"], f"{p}:{lineno}")
        yield obj["text"], obj.get("label")


def _media_lines(p: Path, f: IO[bytes]) -> list[tuple[int, dict]] | None:
    """The records of a .jsonl file when any names an image or audio file, else None (the
    file is read again as text)."""
    from fp8export.inputs.media import media_fields

    records, media = [], False
    for lineno, line in _lines(p, f):
        if not line.strip():
            continue
        try:
            obj = parse_json(line, f"{p}:{lineno}", "the line")
        except Fp8ExportError:  # the text reader says what is wrong with the line
            f.seek(0)
            return None
        if isinstance(obj, dict):
            media = media or bool(media_fields(obj))
            records.append((lineno, obj))
        else:
            records.append((lineno, {}))
    f.seek(0)
    return records if media else None


def _check_unicode(text: str, where: str) -> None:
    """JSON's ``\\ud800`` escapes make lone surrogates, which are not Unicode text (no UTF-8
    encoding exists for them; the tokenizer cannot take them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Fp8ExportError(
            f"{where}: the text holds {text[exc.start]!r} at character {exc.start}, a lone "
            "surrogate (an escape like \\ud800 without its pair), which is not Unicode text. "
            "Fix the line.") from exc


def _open_tokenizer(p: Path, tokenizer_dir: Path | None):
    from fp8export.inputs.tokenizer import open_tokenizer

    if tokenizer_dir is None:
        raise Fp8ExportError(
            f"{p}: text data needs the checkpoint's tokenizer, but no tokenizer folder is known "
            "(a single weights file was given). Pass a Hugging Face folder with tokenizer files, "
            "or give pre-tokenised .npz / .safetensors data with 'input_ids'.")
    tdir = Path(tokenizer_dir)
    return open_tokenizer(tdir.parent if tdir.is_file() else tdir, for_file=p)


# Lines go to the tokenizer process in batches of at most this many lines / bytes.
BATCH_LINES = 256
BATCH_BYTES = 1 << 20


def _encoded(p: Path, texts: Iterator[tuple[str, Any]], tok, wanted
             ) -> Iterator[tuple[str, Any, list]]:
    """``(text, label, ids)`` per line, tokenised a batch at a time. A batch holds at most
    ``wanted()`` lines (the samples still needed), so no line past them is read."""
    lineno = 0
    while True:
        batch: list[tuple[str, Any]] = []
        size = 0
        limit = min(BATCH_LINES, wanted())
        while len(batch) < limit and size < BATCH_BYTES:
            item = next(texts, None)
            if item is None:
                break
            batch.append(item)
            size += len(item[0])
        if not batch:
            return
        what = f"tokenising {p.name} lines {lineno + 1}-{lineno + len(batch)}"
        ids = tok.encode([text for text, _ in batch], what)
        lineno += len(batch)
        for (text, label), row in zip(batch, ids):
            yield text, label, row


def _tokenise(p: Path, texts: Iterator[tuple[str, Any]], tokenizer_dir: Path | None,
              max_samples: int | None, bounds: _Bounds, tokenizer=None):
    label2id: dict[str, int] | None = None
    ids: list[list[int]] = []
    labels: list[Any] | None = None
    labelled: bool | None = None
    skipped = lines = 0
    opened = contextlib.nullcontext(tokenizer) if tokenizer is not None \
        else _open_tokenizer(p, tokenizer_dir)
    with opened as tok:
        n_special = tok.facts["num_special"]
        encoded = _encoded(p, texts, tok, lambda: BATCH_LINES if max_samples is None
                           else max_samples - len(ids))
        # Stop pulling once enough samples are in: nothing past the batch holding them is read.
        while max_samples is None or len(ids) < max_samples:
            item = next(encoded, None)
            if item is None:
                break
            _, label, enc = item
            lines += 1
            bounds.check_count(lines)
            if labelled is None:
                labelled = label is not None
                labels = [] if labelled else None
            elif labelled != (label is not None):
                raise Fp8ExportError(
                    f"{p}: some lines have a 'label' and some do not (sample {lines} "
                    f"{'has none' if labelled else 'has one'}). Give a label on every line or on "
                    "none.")
            # A line that yields only the special tokens (BOS/CLS/SEP) carries no text for the
            # statistics: skip it, and fail below if that leaves nothing.
            if len(enc) <= n_special:
                skipped += 1
                continue
            bounds.check_ids(len(ids), min(enc), max(enc), text=True)
            ids.append(enc)
            if labels is not None:
                if label2id is None:
                    label2id = _label2id(tokenizer_dir)
                labels.append(bounds.check_label(len(ids) - 1,
                                                 _label_value(p, label, label2id, len(ids) - 1)))
        facts = tok.facts
    if not lines:
        raise Fp8ExportError(f"{p}: holds no samples (only blank lines). {_FORMATS_HINT}")
    if not ids:
        raise Fp8ExportError(
            f"{p}: the text tokenises to nothing with the tokenizer in {tokenizer_dir} "
            f"({lines} lines, none giving a non-special token). Check the file's "
            "encoding and that it is the right tokenizer.")
    if skipped:
        info(f"Note: {p}: {skipped} lines tokenised to nothing and were skipped.")
    pad = facts["pad_token_id"] if facts["pad_token_id"] is not None else facts["eos_token_id"]
    return ids, labels, _valid_pad(pad, bounds.vocab_size, f"{tokenizer_dir} (its tokenizer)")


def _label2id(tokenizer_dir: Path | None) -> dict[str, int]:
    from fp8export.checkpoint.model_config import read_model_config

    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return {}
    config = read_model_config(Path(tokenizer_dir)) or {}
    return {str(k): int(v) for k, v in (config.get("label2id") or {}).items()}


def _label_value(p: Path, value: Any, label2id: dict[str, int], i: int) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value in label2id:
            return label2id[value]
        if value.lstrip("-").isdigit() and len(value) <= 19:
            return int(value)
        raise Fp8ExportError(
            f"{p}: sample {i + 1} has label {value[:40]!r}, which the checkpoint's config.json "
            f"label2id does not name (known: {sorted(label2id) or 'none'}). Use integer labels.")
    raise Fp8ExportError(f"{p}: sample {i + 1} has label {str(value)[:40]!r}; use an int or a "
                         "string.")


_INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
# Compression a real token file reaches (ids and masks compress well, up to deflate's own
# ~1000:1 for a constant array; a bomb declares more): io/safezip.py's rule at this ratio.
_MAX_NPZ_RATIO = 1000


def _npy_header(p: Path, name: str, stream: IO[bytes]):
    """``(shape, fortran_order, dtype)`` of a ``.npy`` member, read from its stream."""
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(stream)
        else:  # 3.0 exists for structured dtypes with non-Latin-1 field names only
            raise ValueError(f".npy format version {version[0]}.{version[1]}, which numpy "
                             "writes only for structured arrays; token ids are plain integers")
    except (ValueError, TypeError, SyntaxError, OverflowError, EOFError) as exc:
        raise Fp8ExportError(f"{p}: member {name!r} is not a readable .npy array ({exc}). "
                             f"{_FORMATS_HINT}") from exc
    if dtype.hasobject:
        raise Fp8ExportError(f"{p}: {name!r} holds Python objects; refused (token ids are "
                             "integers). Save a plain integer array.")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise Fp8ExportError(f"{p}: {name!r} has the structured dtype {dtype}; token ids, "
                             "masks and labels are plain integer arrays. Save them so.")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise Fp8ExportError(f"{p}: {name!r} declares shape {tuple(shape)}; sizes must be "
                             "integers >= 0. The file is corrupt.")
    return tuple(shape), fortran, dtype


def _npy_member(p: Path, name: str, stream: IO[bytes], stored: int):
    """One ``.npy`` member, its header checked against the member's size before anything is
    allocated (``np.load`` would allocate what the header declares), and never more than
    :data:`MAX_TOKEN_BYTES` of data: a zip member can inflate a few megabytes into gigabytes
    within any plausible compression ratio."""
    import numpy as np

    shape, fortran, dtype = _npy_header(p, name, stream)
    count = 1
    for d in shape:
        count *= int(d)
    need = count * dtype.itemsize
    if need != stored - stream.tell():
        raise Fp8ExportError(
            f"{p}: {name!r} declares shape {shape} ({need} bytes) but holds "
            f"{stored - stream.tell()} bytes; the file is corrupt.")
    if need > MAX_TOKEN_BYTES:
        raise Fp8ExportError(
            f"{p}: {name!r} holds {need} bytes of token data (limit {MAX_TOKEN_BYTES}: "
            "calibration and verification use thousands of samples, not hundreds of millions "
            "of tokens); refused before decompressing it. Give a smaller file.")
    data = stream.read(need)
    if len(data) != need:
        raise Fp8ExportError(f"{p}: {name!r} ends early ({len(data)} of {need} bytes); the "
                             "file is corrupt.")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape,
                                                                  order="F" if fortran else "C")


def _npz_arrays(p: Path, f: IO[bytes]) -> dict[str, Any]:
    import zipfile
    import zlib

    errors = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError,
              NotImplementedError, RuntimeError)
    try:
        zf = zipfile.ZipFile(f)
    except errors as exc:
        raise Fp8ExportError(f"{p}: cannot read it as .npz ({type(exc).__name__}: {exc}). "
                             f"{_FORMATS_HINT}") from exc
    out: dict[str, Any] = {}
    with zf:
        found = sorted(i.filename.removesuffix(".npy") for i in zf.infolist())
        for key in ("input_ids", "attention_mask", "labels"):
            try:
                member = zf.getinfo(f"{key}.npy")
            except KeyError:
                continue
            check_ratio(p, member, _MAX_NPZ_RATIO)
            if member.file_size > DATA.max_bytes:
                raise Fp8ExportError(
                    f"{p}: {key!r} declares {member.file_size} bytes (limit {DATA.max_bytes} for "
                    "a data file); refused before decompressing it (a zip bomb or a corrupt "
                    "file).")
            try:
                with zf.open(member) as stream:
                    out[key] = _npy_member(p, key, _Counted(stream), member.file_size)
            except errors as exc:
                raise Fp8ExportError(f"{p}: cannot read {key!r} ({type(exc).__name__}: {exc}). "
                                     f"{_FORMATS_HINT}") from exc
    out["__found__"] = found
    return out


class _Counted:
    """A read-only stream that knows how far it has read (zip member streams do not)."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.pos = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.pos += len(data)
        return data

    def tell(self) -> int:
        return self.pos


def _safetensors_arrays(p: Path) -> dict[str, Any]:
    from fp8export.checkpoint.safetensors_reader import SafetensorsFile

    sf = SafetensorsFile(p)  # validated header: offsets, dtypes and sizes agree with the file
    try:
        out: dict[str, Any] = {"__found__": sorted(t.name for t in sf.tensors)}
        dtypes = {t.name: t.dtype for t in sf.tensors}
        for key in ("input_ids", "attention_mask", "labels"):
            if key not in dtypes:
                continue
            begin, end = sf.spans[key]
            if end - begin > MAX_TOKEN_BYTES:
                raise Fp8ExportError(
                    f"{p}: {key!r} holds {end - begin} bytes of token data (limit "
                    f"{MAX_TOKEN_BYTES}: calibration and verification use thousands of samples);"
                    " refused. Give a smaller file.")
            t = sf.load(key)
            out[key] = (t.numpy() if dtypes[key] in _INT_DTYPES else t.float().numpy())
        return out
    finally:
        sf.close()


def _read_tokens(p: Path, f: IO[bytes], suffix: str, max_samples: int | None, bounds: _Bounds):
    import numpy as np

    arrays = _npz_arrays(p, f) if suffix == ".npz" else _safetensors_arrays(p)
    found = arrays.pop("__found__")
    if "input_ids" not in arrays:
        raise Fp8ExportError(
            f"{p}: has no 'input_ids' array (found: {found or 'nothing'}). Save the "
            "token ids as 'input_ids' [N, T] (and optionally 'attention_mask').")
    ids = np.asarray(arrays["input_ids"])
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise Fp8ExportError(
            f"{p}: 'input_ids' has shape {ids.shape}; expected [N, T] with N, T > 0.")
    if not np.issubdtype(ids.dtype, np.integer):
        raise Fp8ExportError(f"{p}: 'input_ids' has dtype {ids.dtype}; token ids must be integers.")
    if ids.shape[1] > MAX_TOKENS_PER_SAMPLE:
        raise Fp8ExportError(f"{p}: 'input_ids' rows hold {ids.shape[1]} tokens (limit "
                             f"{MAX_TOKENS_PER_SAMPLE}); split the samples.")
    if max_samples is None:
        bounds.check_count(ids.shape[0])
    mask = arrays.get("attention_mask")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype.kind not in "biuf":
            raise Fp8ExportError(f"{p}: 'attention_mask' has dtype {mask.dtype}; a mask holds "
                                 "numbers (or booleans), 1 for tokens and 0 for padding.")
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
        if not np.issubdtype(labels_arr.dtype, np.integer):
            raise Fp8ExportError(f"{p}: 'labels' has dtype {labels_arr.dtype}; labels must be "
                                 "integers.")
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
        bounds.check_ids(i, int(row.min()), int(row.max()))
        out.append([int(t) for t in row])
        if labels is not None:
            if labels_arr.ndim == 1:
                labels.append(bounds.check_label(i, int(labels_arr[i])))
            else:
                lab = labels_arr[i][keep]
                bounds.check_token_labels(i, lab)
                labels.append(tuple(int(t) for t in lab))
    if not out:
        raise Fp8ExportError(
            f"{p}: every sample's attention_mask is all zeros; there are no tokens to use.")
    if skipped:
        info(f"Note: {p}: {skipped} samples with an all-zero attention_mask were skipped.")
    return out, labels


def _pad_id_of(tokenizer_dir: Path | None, vocab_size: int | None = None) -> int:
    """The pad id from the checkpoint's configs (0 if none; see :func:`_valid_pad`)."""
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return 0
    folder = Path(tokenizer_dir)
    for name in ("tokenizer_config.json", "config.json"):
        path = folder / name
        if not os.path.lexists(path):
            continue
        data = read_json_object(path, CONFIG, root=folder, what=name)
        for key in ("pad_token_id", "eos_token_id"):
            v = data.get(key)
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int) and not isinstance(v, bool):
                return _valid_pad(v, vocab_size, f"{path} ({key})")
    return 0


def _valid_pad(pad: int | None, vocab_size: int | None, source: str) -> int:
    """``pad`` if it is a token id of the model, else 0, said once: padded positions are masked
    out, but they still go through the embedding, so the id must index a row of it (a tokenizer
    whose pad token was added after the model's vocabulary was fixed has one beyond it)."""
    if pad is None:
        return 0
    limit = vocab_size or MAX_LABEL + 1
    if 0 <= pad < limit:
        return int(pad)
    info(f"Note: {source}: pad token id {pad} is outside the model's vocabulary (0..{limit - 1});"
         " batches are padded with id 0 instead (padded positions are masked out).")
    return 0


def as_samples(token_lists: Sequence[Sequence[int]], pad_id: int = 0,
               source: str | Path = "<memory>") -> Samples:
    """Build :class:`Samples` from token lists already in memory (tests, library users)."""
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise Fp8ExportError(f"{source}: samples must be non-empty token lists.")
    return Samples(source=Path(str(source)), input_ids=tuple(tuple(int(x) for x in t)
                                                              for t in token_lists),
                   pad_id=int(pad_id))
