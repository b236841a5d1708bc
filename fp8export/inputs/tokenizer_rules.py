"""What a real ``tokenizer.json`` holds, checked before the tokenizers library runs it.

The tokenizers library is native code: once it runs, a hostile file can take all memory or
CPU time, and our error handling no longer applies (a failed allocation aborts the process, a
panic escapes as ``PanicException``). The file is checked first against what released
tokenizers use (GPT-2, Llama 2/3, Mistral, Qwen, Gemma, DeepSeek, BERT, T5, SmolLM …), with
room to spare; the tokenizer then runs in a child process with memory and CPU limits
(:mod:`fp8export.inputs.tokenizer_process`) for what no static rule can see.

Rules (each refusal names the file, the component and the rule):

* **Text growth.** ``Replace`` (normalizer or decoder) multiplies the text by up to
  ``len(content) / len(pattern)`` (a regex pattern counts as matching one character, or none:
  ``len(content) + 1``); ``Prepend`` adds a fixed string. The product over a chain must stay
  within :data:`MAX_GROWTH` (real ones: 1 — ``" "`` → ``"▁"``); replacement strings within
  :data:`MAX_REPLACEMENT_CHARS`.
* **Regex patterns** (``Split``, ``Replace``): at most :data:`MAX_PATTERN_CHARS`; no
  backreferences; no repetition of a group that itself repeats or alternates (``(a+)+``,
  ``(a|a)*``: exponential backtracking); at most :data:`MAX_REPEATS_PER_BRANCH` unbounded
  repetitions in one alternative (``a*a*a*b``: polynomial backtracking; real patterns have 2).
* **Counts.** At most :data:`MAX_STEPS` components in a normalizer, pre-tokenizer, decoder or
  post-processor chain (nesting included), at most :data:`MAX_SPLITS` regex splits.
* **Special tokens.** A post-processor's special token expands to at most
  :data:`MAX_SPECIAL_IDS` ids (real: 1), a template has at most :data:`MAX_TEMPLATE_PIECES`
  pieces; added tokens at most :data:`MAX_ADDED_TOKEN_CHARS` characters each.
* **Sizes.** Vocabularies and merges within the model-size limits of ``config.json``; a fixed
  padding length within :data:`MAX_PADDING`; WordPiece words of at most
  :data:`MAX_WORDPIECE_CHARS` characters (matching is cubic in a word's length).

Component types the library does not define are left to it: it refuses them when loading.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

MAX_GROWTH = 16
MAX_REPLACEMENT_CHARS = 64
MAX_PREPEND_CHARS = 16
MAX_PATTERN_CHARS = 4096
MAX_REPEATS_PER_BRANCH = 2
MAX_STEPS = 32
MAX_SPLITS = 8
MAX_DEPTH = 4
MAX_SPECIAL_IDS = 8
MAX_TEMPLATE_PIECES = 16
MAX_ADDED_TOKENS = 1 << 20
MAX_ADDED_TOKEN_CHARS = 1024
MAX_VOCAB = 1 << 24
MAX_PADDING = 1 << 20
# WordPiece matches a word in time cubic in its length: BERT's 100 takes microseconds, 10 000
# takes 20 s a word.
MAX_WORDPIECE_CHARS = 1000
# A bounded repetition {n,m} above this backtracks like an unbounded one.
_BOUNDED_UP_TO = 16


class _Refused(Exception):
    pass


def check_tokenizer_json(doc: Any, path: Path) -> None:
    """Raise Fp8ExportError when ``doc`` (a parsed ``tokenizer.json``) breaks a rule above."""
    if not isinstance(doc, dict):
        raise Fp8ExportError(f"{path}: tokenizer.json must hold a JSON object. Restore the "
                             "tokenizer files (tokenizer.save_pretrained).")
    try:
        _check(doc)
    except _Refused as exc:
        raise Fp8ExportError(f"{path}: {exc}; no released tokenizer needs that, and running it "
                             "could exhaust memory or time. Refused: restore the tokenizer "
                             "files, or give pre-tokenised .npz / .safetensors data.") from None


def _check(doc: dict[str, Any]) -> None:
    counts = {"steps": 0, "splits": 0}
    growth = _chain(doc.get("normalizer"), "normalizer", counts, 0)
    if growth > MAX_GROWTH:
        raise _Refused(f"the normalizer can grow text {growth:.0f}-fold (limit {MAX_GROWTH})")
    counts["steps"] = 0
    _chain(doc.get("pre_tokenizer"), "pre_tokenizer", counts, 0)
    counts["steps"] = 0
    growth = _chain(doc.get("decoder"), "decoder", counts, 0)
    if growth > MAX_GROWTH:
        raise _Refused(f"the decoder can grow text {growth:.0f}-fold (limit {MAX_GROWTH})")
    counts["steps"] = 0
    _chain(doc.get("post_processor"), "post_processor", counts, 0)
    _added_tokens(doc.get("added_tokens"))
    _model(doc.get("model"))
    padding = doc.get("padding")
    if isinstance(padding, dict) and isinstance(padding.get("strategy"), dict):
        fixed = padding["strategy"].get("Fixed")
        if isinstance(fixed, int) and fixed > MAX_PADDING:
            raise _Refused(f"padding to a fixed {fixed} tokens (limit {MAX_PADDING})")


def _chain(node: Any, slot: str, counts: dict[str, int], depth: int) -> float:
    """Walk one component (and its nested sequence); return how much it can grow text."""
    if node is None:
        return 1.0
    if not isinstance(node, dict):
        raise _Refused(f"{slot} is {type(node).__name__}, not a component object")
    if depth > MAX_DEPTH:
        raise _Refused(f"{slot} nests sequences deeper than {MAX_DEPTH}")
    counts["steps"] += 1
    if counts["steps"] > MAX_STEPS:
        raise _Refused(f"{slot} chains more than {MAX_STEPS} steps")
    kind = node.get("type")
    where = f"{slot} {kind}"
    if kind == "Sequence":
        growth = 1.0
        for key in ("normalizers", "pretokenizers", "decoders", "processors"):
            for child in node.get(key) or []:
                growth *= _chain(child, slot, counts, depth + 1)
        return growth
    if kind == "Replace":
        return _replace(node, where)
    if kind == "Prepend":
        text = _string(node.get("prepend"), where, "prepend")
        if len(text) > MAX_PREPEND_CHARS:
            raise _Refused(f"{where} prepends {len(text)} characters (limit {MAX_PREPEND_CHARS})")
        return 1.0 + len(text)  # counted as a growth: once per piece in a pre-tokenized text
    if kind == "Split":
        counts["splits"] += 1
        if counts["splits"] > MAX_SPLITS:
            raise _Refused(f"{slot} has more than {MAX_SPLITS} regex splits")
        _pattern(node.get("pattern"), where)
        return 1.0
    if kind in ("Metaspace", "CharDelimiterSplit"):
        for key in ("replacement", "delimiter"):
            if key in node and len(_string(node[key], where, key)) > 1:
                raise _Refused(f"{where} {key} is more than one character")
        return 1.0
    if kind in ("WordPiece", "BPEDecoder", "CTC"):
        for key in ("prefix", "suffix", "pad_token", "word_delimiter_token"):
            if key in node and len(_string(node[key], where, key)) > MAX_REPLACEMENT_CHARS:
                raise _Refused(f"{where} {key} is longer than {MAX_REPLACEMENT_CHARS} "
                               "characters")
        return 1.0
    if kind == "TemplateProcessing":
        _template(node, where)
    if kind in ("BertProcessing", "RobertaProcessing"):
        for key in ("sep", "cls"):
            pair = node.get(key)
            if isinstance(pair, list) and pair and isinstance(pair[0], str) \
                    and len(pair[0]) > MAX_ADDED_TOKEN_CHARS:
                raise _Refused(f"{where} {key} token is longer than {MAX_ADDED_TOKEN_CHARS} "
                               "characters")
    return 1.0


def _string(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise _Refused(f"{where} {key} is not a string")
    return value


def _replace(node: dict[str, Any], where: str) -> float:
    content = _string(node.get("content"), where, "content")
    if len(content) > MAX_REPLACEMENT_CHARS:
        raise _Refused(f"{where} replaces with {len(content)} characters (limit "
                       f"{MAX_REPLACEMENT_CHARS})")
    pattern = node.get("pattern")
    if isinstance(pattern, dict) and "String" in pattern:
        text = _string(pattern["String"], where, "pattern")
        if not text:
            raise _Refused(f"{where} replaces the empty string")
        return max(1.0, len(content) / len(text))
    _pattern(pattern, where)
    return max(1.0, len(content) + 1.0)  # a regex may match single characters, or none


def _pattern(pattern: Any, where: str) -> None:
    if not isinstance(pattern, dict) or not pattern:
        raise _Refused(f"{where} has no pattern")
    if "String" in pattern:
        _string(pattern["String"], where, "pattern")
        return
    regex = _string(pattern.get("Regex"), where, "pattern")
    if len(regex) > MAX_PATTERN_CHARS:
        raise _Refused(f"{where} regex is {len(regex)} characters (limit {MAX_PATTERN_CHARS})")
    why = regex_problem(regex)
    if why:
        raise _Refused(f"{where} regex {regex[:60]!r}: {why}")


def regex_problem(regex: str) -> str | None:
    """Why an Oniguruma pattern may backtrack catastrophically, or None (see the rules)."""
    too_many = (f"more than {MAX_REPEATS_PER_BRANCH} unbounded repetitions in one alternative "
                "(polynomial backtracking)")
    # open groups: alternates, repeats inside, repetitions in the current / busiest branch
    stack = [{"alt": False, "rep": False, "cur": 0, "max": 0}]
    last: dict | None = None  # the atom a quantifier applies to (a closed group's dict)
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            nxt = regex[i + 1:i + 2]
            if nxt.isdigit() and nxt != "0" or nxt == "k":
                return "a backreference (matching it can take exponential time)"
            i += 2
            if nxt in "pPxuNo" and regex[i:i + 1] == "{":
                i = regex.find("}", i) + 1 or n
            last = {}
            continue
        if ch == "[":
            i, last = _class_end(regex, i), {}
            continue
        if ch == "(":
            stack.append({"alt": False, "rep": False, "cur": 0, "max": 0})
            i += 1
            if regex[i:i + 1] == "?":  # (?:…) (?i:…) (?<name>…); lookarounds are skipped
                while i < n and regex[i] not in ":)" and not (regex[i] == ">"
                                                              and regex[i - 1] != "?"):
                    i += 1
                i += 1 if i < n and regex[i] in ":>" else 0
            last = None
            continue
        if ch == ")":
            group = stack.pop() if len(stack) > 1 else stack[0]
            group["max"] = max(group["max"], group["cur"])
            stack[-1]["cur"] += group["max"]
            stack[-1]["rep"] |= group["rep"]
            if stack[-1]["cur"] > MAX_REPEATS_PER_BRANCH:
                return too_many
            last = group
            i += 1
            continue
        if ch == "|":
            top = stack[-1]
            top["alt"], top["max"], top["cur"] = True, max(top["max"], top["cur"]), 0
            last = None
            i += 1
            continue
        if ch in "*+?{":
            unbounded, end = _quantifier(regex, i)
            if end == i:  # a literal "{"
                last, i = {}, i + 1
                continue
            i = end + (1 if regex[end:end + 1] in ("?", "+") else 0)  # lazy / possessive
            if not unbounded or last is None:
                continue
            if last.get("rep"):
                return "a repeated group that itself repeats (exponential backtracking)"
            if last.get("alt"):
                return "a repeated group of alternatives (exponential backtracking)"
            stack[-1]["rep"] = True
            stack[-1]["cur"] += 1
            if stack[-1]["cur"] > MAX_REPEATS_PER_BRANCH:
                return too_many
            continue
        last, i = {}, i + 1
    return None


def _class_end(regex: str, i: int) -> int:
    """Index after the character class opening at ``i`` (nested classes, escapes)."""
    depth, i = 0, i
    n = len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            if regex[i + 1:i + 2] == "^":
                i += 1
            if regex[i + 1:i + 2] == "]":  # "[]…]": a literal ] first
                i += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _quantifier(regex: str, i: int) -> tuple[bool, int]:
    """(unbounded, index after) of the quantifier at ``i``; index ``i`` if ``{`` is literal."""
    ch = regex[i]
    if ch in "*+":
        return True, i + 1
    if ch == "?":
        return False, i + 1
    close = regex.find("}", i)
    body = regex[i + 1:close] if close > 0 else ""
    lo, comma, hi = body.partition(",")
    if close < 0 or not (lo.isdigit() or lo == "" and comma) or hi and not hi.isdigit():
        return False, i
    unbounded = bool(comma) and (not hi or int(hi) > _BOUNDED_UP_TO)
    return unbounded, close + 1


def _template(node: dict[str, Any], where: str) -> None:
    for key in ("single", "pair"):
        pieces = node.get(key) or []
        if isinstance(pieces, list) and len(pieces) > MAX_TEMPLATE_PIECES:
            raise _Refused(f"{where} {key} template has {len(pieces)} pieces (limit "
                           f"{MAX_TEMPLATE_PIECES})")
    specials = node.get("special_tokens") or {}
    if not isinstance(specials, dict):
        raise _Refused(f"{where} special_tokens is not an object")
    for name, token in specials.items():
        ids = token.get("ids") if isinstance(token, dict) else None
        if isinstance(ids, list) and len(ids) > MAX_SPECIAL_IDS:
            raise _Refused(f"{where} special token {str(name)[:40]!r} expands to {len(ids)} "
                           f"ids (limit {MAX_SPECIAL_IDS}; real ones are one id)")


def _added_tokens(tokens: Any) -> None:
    if tokens is None:
        return
    if not isinstance(tokens, list):
        raise _Refused("added_tokens is not a list")
    if len(tokens) > MAX_ADDED_TOKENS:
        raise _Refused(f"{len(tokens)} added tokens (limit {MAX_ADDED_TOKENS})")
    for token in tokens:
        content = token.get("content") if isinstance(token, dict) else None
        if isinstance(content, str) and len(content) > MAX_ADDED_TOKEN_CHARS:
            raise _Refused(f"an added token of {len(content)} characters (limit "
                           f"{MAX_ADDED_TOKEN_CHARS})")


def _model(model: Any) -> None:
    if not isinstance(model, dict):
        return
    for key in ("vocab", "merges"):
        entries = model.get(key)
        if isinstance(entries, (list, dict)) and len(entries) > MAX_VOCAB:
            raise _Refused(f"model {key} has {len(entries)} entries (limit {MAX_VOCAB})")
    chars = model.get("max_input_chars_per_word")
    if isinstance(chars, int) and chars > MAX_WORDPIECE_CHARS:
        raise _Refused(f"model max_input_chars_per_word is {chars} (limit {MAX_WORDPIECE_CHARS};"
                       " WordPiece takes time cubic in a word's length)")
