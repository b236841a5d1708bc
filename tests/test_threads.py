"""CPU threads of the commands that run models (fp8export/_threads.py; speed: bench/threads.py):
libgomp's wait policy is PASSIVE before torch loads and torch gets one thread per physical core
this process may use, unless the user set either. Each case runs in a fresh interpreter (the
wait policy is read once, when torch loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "tiny-llama"


def _run(code: str, **env: str) -> list[str]:
    """The words of the code's last ``RESULT`` line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**clean, "CI": "1", **env}, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1].split()[1:]


def test_calibrate_runs_with_the_fitted_settings(tmp_path):
    code = (
        "import os, sys\nfrom fp8export.cli import main\n"
        f"code = main(['calibrate', {str(SAMPLE / 'model')!r}, '--calib-data', "
        f"{str(SAMPLE / 'data' / 'calib.txt')!r}, '--calib-samples', '4', '-o', "
        f"{str(tmp_path / 'a.json')!r}])\n"
        "import torch\nfrom fp8export._threads import cpu_threads\n"
        "print('RESULT', code, os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads(),"
        " cpu_threads())\n")
    code_, policy, threads, fitted = _run(code)
    assert code_ == "0" and policy == "PASSIVE" and threads == fitted


def test_convert_sets_the_wait_policy_before_torch_loads(tmp_path):
    code = (
        "import os, sys\nfrom fp8export.cli import main\n"
        f"code = main(['convert', {str(SAMPLE / 'model')!r}, '-o', {str(tmp_path / 'o')!r}])\n"
        "print('RESULT', code, os.environ.get('OMP_WAIT_POLICY'))\n")
    assert _run(code) == ["0", "PASSIVE"]


def test_the_users_settings_win():
    code = ("import os\nfrom fp8export._threads import prepare, fit_torch\nprepare()\n"
            "import torch\nprint('RESULT', os.environ['OMP_WAIT_POLICY'], fit_torch())\n")
    assert _run(code, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1") == ["ACTIVE", "1"]


def test_threads_follow_the_affinity_mask():
    code = ("import os\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "from fp8export._threads import cpu_threads, fit_torch\n"
            "print('RESULT', cpu_threads(), fit_torch())\n")
    assert _run(code) == ["1", "1"]
