"""Run llm-compressor's ``model_free_ptq`` on a model folder: the peer's data-free path.

Runs inside the peer venv (``scripts/peer_venv.sh``), never in the dev venv. Usage:
``python llmcompressor_model_free.py SCHEME MODEL_DIR OUT_DIR [IGNORE,...]``. It quantizes the
safetensors files without building the model: every 2-D weight but the norms and the modules
``IGNORE`` names, embeddings included (llm-compressor's own default ignore is empty).
"""

import sys


def main(scheme: str, model_dir: str, out: str, ignore: str = "") -> None:
    from llmcompressor import model_free_ptq

    model_free_ptq(model_dir, out, scheme=scheme, ignore=[i for i in ignore.split(",") if i])


if __name__ == "__main__":
    main(*sys.argv[1:5])
