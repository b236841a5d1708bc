"""convert --scheme NAME against the peer's own table: for every scheme name compressed-tensors
also defines (``PRESET_SCHEMES``, read from the installed peer, not copied), the config group
our folder declares has the preset's weight and input arguments (strategy, dynamic, block
structure, group size, bits, type).

compressed-tensors runs in the peer venv (``scripts/peer_venv.sh``), as a subprocess; without it
this test skips, naming the script.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from peer_venv import PEER_PY

from fp8export.convert.schemes import SCHEMES

ARGS = ("strategy", "dynamic", "block_structure", "group_size", "num_bits", "type")
DUMP = f"""
import json
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
def plain(v):
    return v.value if hasattr(v, "value") else v
print(json.dumps({{name: {{role: {{a: plain(getattr(args, a)) for a in {ARGS!r}}}
                         for role, args in preset.items()}}
                  for name, preset in PRESET_SCHEMES.items() if name in {sorted(SCHEMES)!r}}}))
"""


def _presets() -> dict | None:
    if not PEER_PY.exists():
        return None
    run = subprocess.run([str(PEER_PY), "-c", DUMP], capture_output=True, text=True,
                         timeout=300)
    return json.loads(run.stdout) if run.returncode == 0 else None


def test_schemes_declare_the_peer_presets(markov_llama, tmp_path, run_cli):
    presets = _presets()
    if presets is None:
        pytest.skip(f"compressed-tensors peer venv missing ({PEER_PY}): run "
                    "`bash scripts/peer_venv.sh`")
    from fp8_folders import markov_tokens

    assert set(presets) == set(SCHEMES)  # every scheme here is a peer preset of that name
    calib = tmp_path / "calib.npz"
    np.savez(calib, input_ids=markov_tokens(256, 16, 32, seed=1).numpy())
    for name, preset in presets.items():
        data = ["--calib-data", calib] if SCHEMES[name].options["scales"] == "calibrate" else []
        r = run_cli("convert", markov_llama, "-o", tmp_path / name, "--scheme", name, *data)
        assert r.exit_code == 0, r.output
        group = json.loads((tmp_path / name / "config.json").read_text())[
            "quantization_config"]["config_groups"]["group_0"]
        for role, args in preset.items():
            ours = {a: group[role].get(a) for a in ARGS}
            assert ours == args, (name, role)
