"""Shared fixtures and marker handling.

Markers (pyproject, --strict-markers): ``gpu`` skips without CUDA, ``tensorrt`` skips without
the tensorrt package (the reason names TensorRT) and then without a GPU, ``slow`` runs only with
``--run-slow`` or FP8EXPORT_SLOW=1, ``nightly`` only with ``--run-nightly`` or
FP8EXPORT_NIGHTLY=1 (.github/workflows/nightly.yml; too long for .ci/run, which runs every other
tier: it sets FP8EXPORT_SLOW=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# transformers copies a checkpoint's auto_map code here before importing it. fp8export never
# lets it, but a regression must not leave a payload in the user's own Hugging Face cache.
# Removed when the session ends (pytest_unconfigure), so no run leaves a folder in the temp dir.
_HF_MODULES = None
if "HF_MODULES_CACHE" not in os.environ:
    _HF_MODULES = tempfile.mkdtemp(prefix="fp8export-test-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = _HF_MODULES
SAMPLES = REPO / "samples"

# Under pytest-xdist (scripts/test.sh runs one worker per core) the workers share the cores:
# each gets its share of torch's intra-op threads, and so do the CLI processes the tests start
# (they inherit it), unless the user set OMP_NUM_THREADS (fit_torch() leaves it alone). Set
# before torch loads: OpenMP reads it once.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    from fp8export._threads import cpu_threads

    os.environ["OMP_NUM_THREADS"] = str(max(1, cpu_threads() // _WORKERS))


def _map_calibration() -> None:
    """Test this checkout's ``calibration/`` as ``fp8export.calibration``, installed or not.

    setup.py maps the folder to that name when installing; from a checkout that is not
    installed (or whose venv holds another install) nothing does, and every module importing
    it fails to collect. The mapping here is the same one: the folder as the subpackage.
    """
    name, folder = "fp8export.calibration", REPO / "calibration"
    found = importlib.util.find_spec(name)
    if found is not None and Path(found.origin).resolve().parent == folder:
        return
    import fp8export

    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    fp8export.calibration = module


_map_calibration()

# open_checkpoint loads the built-in readers only while its registry is empty; a reader
# registered earlier by another module (e.g. Transformer Engine's) would hide them. Loading
# them here keeps the tests independent of collection order.
from fp8export.checkpoint import source as _source  # noqa: E402

_source._load_builtin_readers()


def pytest_unconfigure(config):
    if _HF_MODULES is not None:
        shutil.rmtree(_HF_MODULES, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--run-nightly", action="store_true", default=False,
                     help="run tests marked nightly (minutes each)")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Files whose tests take minutes together: sent to the workers first (scripts/test.sh runs
# `--dist loadfile --no-loadscope-reorder`: a file runs whole on one worker, files are handed out
# in collection order), so that the workers end together instead of one running a long file
# alone at the end. Order only: a file missing here just starts later. From `--durations`.
HEAVY_FIRST = (
    "tests/corrupt/test_corpus.py",  # ~27% of a CI run: every hostile case as its own process
    "tests/families/test_family_matrix.py",
    "tests/families/test_next_families.py",
    "tests/onnx/test_modelopt_reference.py",
    "tests/onnx/test_onnx_sample_lm.py",
    "tests/cli/test_readme_recipes.py",
    "tests/test_distributed.py",
    "tests/reliability/test_kill.py",
    "tests/reliability/test_signals.py",
)


def _heavy_first(items) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per CPU this process may use (its affinity mask and cgroup
    quota; xdist's own count ignores both), at most one per 3 GiB of available memory."""
    from fp8export._threads import _allowed_cpus, _cgroup_quota

    n = len(_allowed_cpus())
    quota = _cgroup_quota()
    memory = _available_memory()
    if quota:
        n = min(n, quota)
    if memory:
        n = min(n, memory // (3 << 30))
    return max(1, n)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the workers' files are handed out in
        _heavy_first(items)
    run_slow = config.getoption("--run-slow") or os.environ.get("FP8EXPORT_SLOW") == "1"
    run_nightly = config.getoption("--run-nightly") or os.environ.get("FP8EXPORT_NIGHTLY") == "1"
    has_cuda = None
    has_trt = importlib.util.find_spec("tensorrt") is not None
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: use --run-slow or FP8EXPORT_SLOW=1"))
        if "nightly" in item.keywords and not run_nightly:
            item.add_marker(pytest.mark.skip(
                reason="nightly: use --run-nightly or FP8EXPORT_NIGHTLY=1"))
        if "tensorrt" in item.keywords and not has_trt:  # the reason a reader needs first
            item.add_marker(pytest.mark.skip(
                reason="needs TensorRT (the tensorrt Python package, 10.x/11.x) and an FP8 GPU; "
                       "TensorRT is not installed here"))
        elif "gpu" in item.keywords or "tensorrt" in item.keywords:
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                what = "TensorRT needs" if "tensorrt" in item.keywords else "needs"
                item.add_marker(pytest.mark.skip(reason=f"{what} a CUDA GPU"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture()
def run_cli():
    """Run the real CLI in-process with click's CliRunner; returns the click Result."""
    from click.testing import CliRunner

    from fp8export.cli import cli

    def _run(*args: str, **kwargs):
        runner = CliRunner()
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False, **kwargs)

    return _run


@pytest.fixture()
def python_exe() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def keras_float8_folder(tmp_path_factory) -> Path:
    """The shipped Keras float8 sample converted with ``--scales history`` (read-only)."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    out = tmp_path_factory.mktemp("keras-float8") / "fp8"
    convert(ConvertConfig(checkpoint=SAMPLES / "keras-float8" / "model" / "float8_model.keras",
                          output=out, scales="history"))
    return out


@pytest.fixture(scope="session")
def keras_probe_server(tmp_path_factory):
    """A warm server for the Keras probe's child (tests/warm_process.py), started on first use."""
    from warm_process import KerasProbeLauncher, WarmPython

    from fp8export.checkpoint import keras_probe

    server = WarmPython(KerasProbeLauncher.PRELOAD, cwd=REPO,
                        scratch=tmp_path_factory.mktemp("keras-probe"),
                        env=dict(os.environ, **{keras_probe._CHILD_ENV: "1"}))
    yield server
    server.close()


@pytest.fixture()
def warm_keras_probe(keras_probe_server, monkeypatch):
    """For the Keras fuzz tests: the probe's child forked from the warm server, not a fresh
    interpreter (tests/warm_process.py: KerasProbeLauncher)."""
    from warm_process import KerasProbeLauncher

    from fp8export.checkpoint import keras_probe

    monkeypatch.setattr(keras_probe, "subprocess", KerasProbeLauncher(keras_probe_server))


@pytest.fixture()
def dict_ckpt():
    """The DictCheckpoint class (a fixture, so tests need no import of a helper module)."""
    from tiny_checkpoints import DictCheckpoint

    return DictCheckpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    import tiny_checkpoints

    return tiny_checkpoints.tiny_llama(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory) -> Path:
    import tiny_checkpoints

    return tiny_checkpoints.tiny_llama_sharded(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    import tiny_checkpoints

    return tiny_checkpoints.tiny_gpt2(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    import tiny_checkpoints

    return tiny_checkpoints.tiny_bert(tmp_path_factory)


# The trained tiny Llama of tests/fp8_folders.py and FP8 folders made from it, built once a
# session for the verify, analysis and report tests (each names them as its own tests do).
@pytest.fixture(scope="session")
def markov_llama(tmp_path_factory):
    from fp8_folders import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("ref") / "tiny-llama")


@pytest.fixture(scope="session")
def markov_fp8(markov_llama, tmp_path_factory):
    from fp8_folders import make_fp8_folder

    return make_fp8_folder(markov_llama, tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8")


@pytest.fixture(scope="session")
def markov_damaged_fp8(markov_fp8, tmp_path_factory):
    import shutil

    from fp8_folders import DAMAGED, damage_scale

    out = tmp_path_factory.mktemp("damaged") / "tiny-llama-fp8-damaged"
    shutil.copytree(markov_fp8, out)
    damage_scale(out, DAMAGED, 8.0)
    return out


@pytest.fixture(scope="session")
def markov_eval_npz(tmp_path_factory):
    """16 held-out sequences of 48 tokens from the tiny Llama's own Markov chain."""
    import numpy as np
    from fp8_folders import markov_tokens

    path = tmp_path_factory.mktemp("data") / "eval.npz"
    np.savez(path, input_ids=markov_tokens(256, 16, 48, seed=99).numpy())
    return path
