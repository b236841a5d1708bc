"""The shipped CI gate and fp8export's own CI run the same script on a plain install.

.github/workflows/fp8-gate.yml cannot run here; what can drift is checked: its gate step is
scripts/fp8_gate.sh (which scripts/install_check.sh, run by .ci/run, also runs on a fresh wheel
install), it installs fp8export as a user does (not editable, no dev extra), and the paths it
names exist.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "fp8-gate.yml"


def _steps() -> list[dict]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    (job,) = doc["jobs"].values()
    return job["steps"]


def test_the_workflow_runs_the_gate_script():
    runs = [s.get("run", "") for s in _steps()]
    assert any(r.strip() == "bash scripts/fp8_gate.sh" for r in runs)
    assert not any("fp8export convert" in r or "fp8export verify" in r for r in runs), \
        "gate commands belong in scripts/fp8_gate.sh, where CI tests them"


def test_the_workflow_installs_like_a_user():
    install = next(s["run"] for s in _steps() if s.get("name", "").startswith("Install"))
    assert '"torch==2.13.0"' in install
    assert "pip install -e" not in install and "dev" not in install
    assert "pip install ." in install


def test_ci_runs_the_same_gate_on_a_fresh_install():
    check = (REPO / "scripts" / "install_check.sh").read_text()
    assert 'bash "$REPO/scripts/fp8_gate.sh"' in check
    assert "bash scripts/install_check.sh" in (REPO / ".ci" / "run").read_text()


def test_the_paths_the_workflow_names_exist():
    env = yaml.safe_load(WORKFLOW.read_text())["env"]
    for key in ("MODEL", "CALIB_DATA", "EVAL_DATA"):
        assert (REPO / env[key]).exists(), env[key]
    gate = (REPO / "scripts" / "fp8_gate.sh").read_text()
    for key in ("MODEL", "CALIB_DATA", "EVAL_DATA", "THRESHOLDS", "OUT", "REPORTS"):
        assert f"{key}=${{{key}:-" in gate, key  # the workflow's env reaches the script
