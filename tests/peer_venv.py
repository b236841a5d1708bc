"""The llm-compressor peer venv (``scripts/peer_venv.sh`` -> ``.venv-peers``, or
``FP8EXPORT_PEER_VENV``): its interpreter, and a module fixture that skips without it.

The probe imports llmcompressor in that venv (seconds: it loads torch and transformers), so it
runs once per process, when the first peer test starts, not while collecting.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = Path(os.environ.get("FP8EXPORT_PEER_VENV", ROOT / ".venv-peers")) / "bin" / "python"


@functools.cache
def peer_ok() -> bool:
    if not PEER_PY.exists():
        return False
    return subprocess.run([str(PEER_PY), "-c", "import llmcompressor"],
                          capture_output=True).returncode == 0


@pytest.fixture(autouse=True, scope="module")
def needs_peer():
    """Import into a test module (autouse): its tests skip, naming the script, without the
    peer venv."""
    if not peer_ok():
        pytest.skip(f"llm-compressor peer venv missing ({PEER_PY}): run "
                    "`bash scripts/peer_venv.sh`")
