"""The worst samples of a verification, with the text where the candidate diverged most.

For each of the samples with the largest mean KL: the tokens up to the position of its largest
KL (decoded with the reference's tokenizer), the token there, and what each model predicted
next. Sample text is untrusted input: :func:`display_text` makes control and direction-changing
characters visible and bounds the length here; every renderer escapes for its own format.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

WORST = 10
CONTEXT_TOKENS = 32  # tokens shown before the divergence
MAX_CONTEXT_CHARS = 200
MAX_TOKEN_CHARS = 40


def display_text(text: str, limit: int, keep: str = "start") -> str:
    """``text`` safe to show on one line, at most ``limit`` characters (plus an ellipsis).

    Newlines and tabs become ⏎ and ⇥; other control, format (bidi overrides, zero-width) and
    unassigned characters become ``\\u202e``-style escapes, so nothing reorders or hides text.
    ``keep``: which end survives the cut ("start", or "end" for the context before a token).
    """
    out = []
    for ch in text:
        if ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("⇥")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    s = "".join(out)
    if len(s) <= limit:
        return s
    return s[:limit] + "…" if keep == "start" else "…" + s[len(s) - limit:]


def _decoder(folder: Path, sequences: list[list[int]], tokenizer=None):
    """A ``decode(ids) -> str`` that knows the texts of ``sequences``, decoded at once by the
    reference's tokenizer (in its limited child process: ``tokenizer`` if open, else one is
    opened; False: it was refused already); ids shown as ``[id]`` where there is no tokenizer,
    or it is refused or fails (a broken tokenizer must not lose the report)."""
    import contextlib

    from fp8export._progress import info
    from fp8export.errors import Fp8ExportError
    from fp8export.inputs.tokenizer import has_tokenizer, open_tokenizer

    known: dict[tuple[int, ...], str] = {}
    if tokenizer is not False and (tokenizer is not None or has_tokenizer(folder)) \
            and sequences:
        unique = list(dict.fromkeys(tuple(s) for s in sequences))
        try:
            with (contextlib.nullcontext(tokenizer) if tokenizer is not None
                  else open_tokenizer(folder)) as tok:
                texts = tok.decode([list(s) for s in unique], "decoding the report's samples")
            known = {s: t for s, t in zip(unique, texts) if t is not None}
        except Fp8ExportError as exc:
            info(f"Note: the report shows token ids instead of text: {exc}")

    def decode(ids: list[int]) -> str:
        text = known.get(tuple(ids))
        return text if text is not None else " ".join(f"[{i}]" for i in ids)
    return decode


def _label(config: dict[str, Any], k: int) -> str:
    names = config.get("id2label") or {}
    name = names.get(str(k), names.get(k)) if isinstance(names, dict) else None
    return f"{name} ({k})" if name is not None else f"class {k}"


def worst_samples(per_sample: list[dict[str, Any]], input_ids: tuple[tuple[int, ...], ...],
                  tokenizer_dir: Path, task: str, config: dict[str, Any],
                  n: int = WORST, tokenizer=None) -> list[dict[str, Any]]:
    """The ``n`` samples with the largest mean KL, each with its text around the divergence.

    Args:
        per_sample: the comparison's per-sample rows (``index``, ``kl_mean``, ``kl_max_pos``…).
        input_ids: every sample's token ids, by index.
        tokenizer_dir: the reference's folder (its tokenizer decodes the ids, if it has one).
        task: ``models.task_of`` of the reference ("causal-lm", "seq-cls", …).
        config: the reference's config.json (``id2label`` names classes).
        tokenizer: the reference's open tokenizer, if verify has one (else one is opened).
    """
    rows = sorted(per_sample, key=lambda s: (-_num(s.get("kl_mean")), s["index"]))[:n]
    if not rows:
        return []
    token_level = task != "seq-cls"
    decode = _decoder(Path(tokenizer_dir), _pieces(rows, input_ids, token_level, task),
                      tokenizer)
    out = []
    for s in rows:
        ids = list(input_ids[s["index"]]) if 0 <= s["index"] < len(input_ids) else []
        entry = {k: s.get(k) for k in ("index", "tokens", "kl_mean", "kl_max", "cosine",
                                        "top1_agreement")}
        pos = s.get("kl_max_pos")
        if token_level and ids and isinstance(pos, int) and 0 <= pos < len(ids):
            start = max(0, pos - CONTEXT_TOKENS + 1)
            before = decode(ids[start:pos])
            entry.update(
                position=pos,
                context=("…" if start else "") + display_text(before, MAX_CONTEXT_CHARS, "end"),
                token=display_text(decode([ids[pos]]), MAX_TOKEN_CHARS),
                next_token=(display_text(decode([ids[pos + 1]]), MAX_TOKEN_CHARS)
                            if task == "causal-lm" and pos + 1 < len(ids) else None),
                reference_top1=display_text(decode([s["reference_top1"]]), MAX_TOKEN_CHARS),
                candidate_top1=display_text(decode([s["candidate_top1"]]), MAX_TOKEN_CHARS))
        else:
            entry.update(position=None,
                         context=display_text(decode(ids), MAX_CONTEXT_CHARS) if ids else "",
                         token=None, next_token=None,
                         reference_top1=_label(config, s.get("reference_top1", -1)),
                         candidate_top1=_label(config, s.get("candidate_top1", -1)))
        entry["reference_top1_p"] = s.get("reference_top1_p")
        entry["candidate_top1_p"] = s.get("candidate_top1_p")
        out.append(entry)
    return out


def _pieces(rows: list[dict[str, Any]], input_ids, token_level: bool, task: str
            ) -> list[list[int]]:
    """Every id sequence :func:`worst_samples` will show, to decode them in one request."""
    out: list[list[int]] = []
    for s in rows:
        ids = list(input_ids[s["index"]]) if 0 <= s["index"] < len(input_ids) else []
        pos = s.get("kl_max_pos")
        if token_level and ids and isinstance(pos, int) and 0 <= pos < len(ids):
            out += [ids[max(0, pos - CONTEXT_TOKENS + 1):pos], [ids[pos]],
                    [s["reference_top1"]], [s["candidate_top1"]]]
            if task == "causal-lm" and pos + 1 < len(ids):
                out.append([ids[pos + 1]])
        elif ids:
            out.append(ids)
    return out


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return float("-inf")
    return float("inf") if f != f else f  # NaN counts as the worst
