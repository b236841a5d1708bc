"""Hostile or broken Keras files: one Fp8ExportError naming file/layer; nothing written or run."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_keras_fixtures import copy_pair, edit_config, layer_entry, saved_tiny

from fp8export.checkpoint.source import open_checkpoint
from fp8export.errors import Fp8ExportError
from fp8export.io.safezip import SafeZip

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny(tmp_path_factory)


def _members(keras_path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(keras_path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _write_zip(path: Path, members: list[tuple[zipfile.ZipInfo | str, bytes]],
               compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for info, data in members:
            zf.writestr(info, data)
    return path


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("bad_name,why", [
    ("../evil.json", r"'\.\.' component"), ("a/../../evil", r"'\.\.' component"),
    ("/etc/evil", "absolute path"), ("C:/evil", "absolute path"),
    ("dir\\..\\evil", "backslash"),
])
def test_escaping_entries_are_refused(tiny, tmp_path, bad_name, why):
    members = list(_members(tiny["keras"]).items()) + [(bad_name, b"x")]
    path = _write_zip(tmp_path / "evil.keras", members)
    before = _listing(tmp_path.parent)
    with pytest.raises(Fp8ExportError, match=rf"evil\.keras.*unsafe zip entry.*{why}"):
        open_checkpoint(path)
    assert _listing(tmp_path.parent) == before  # nothing extracted anywhere


def test_symlink_and_duplicate_entries_are_refused(tiny, tmp_path):
    link = zipfile.ZipInfo("config.json.lnk")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    members = list(_members(tiny["keras"]).items())
    with pytest.raises(Fp8ExportError, match="symbolic link"):
        open_checkpoint(_write_zip(tmp_path / "link.keras", members + [(link, b"/etc/passwd")]))
    with pytest.warns(UserWarning, match="Duplicate name"):
        dup = _write_zip(tmp_path / "dup.keras", members + [("config.json", b"{}")])
    with pytest.raises(Fp8ExportError, match="duplicate entry"):
        open_checkpoint(dup)


def test_zip_bomb_is_refused_before_decompressing(tiny, tmp_path):
    # 64 MiB of zeros deflate to ~64 KiB: ratio ~1000, far above any real Keras archive.
    members = list(_members(tiny["keras"]).items())
    path = tmp_path / "bomb.keras"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
        zf.writestr("assets/zeros.bin", bytes(64 * 2**20))
    assert path.stat().st_size < 2**20
    with pytest.raises(Fp8ExportError, match=r"zip bomb"):
        open_checkpoint(path)


def test_lying_size_headers_are_caught(tiny, tmp_path):
    """A central directory that declares a huge size for a small member."""
    members = _members(tiny["keras"])
    path = _write_zip(tmp_path / "lie.keras", list(members.items()))
    raw = bytearray(path.read_bytes())
    # patch the uncompressed size of model.weights.h5 in its central-directory record
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    off = raw.find(b"model.weights.h5", raw.find(b"PK\x01\x02")) - 46
    assert raw[off:off + 4] == b"PK\x01\x02"
    raw[off + 24:off + 28] = (0xFFFFFFF0).to_bytes(4, "little")  # uncompressed size
    path.write_bytes(bytes(raw))
    assert info.file_size < 0xFFFFFFF0
    with pytest.raises(Fp8ExportError, match=r"lie\.keras.*model\.weights\.h5") as err:
        open_checkpoint(path)
    assert "limit" in str(err.value) or "declares" in str(err.value)


def test_truncated_hdf5_is_refused(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path / "pair")
    data = h5.read_bytes()
    h5.write_bytes(data[: len(data) // 2])
    with pytest.raises(Fp8ExportError, match=r"tiny\.weights\.h5.*(truncated|corrupt)"):
        with open_checkpoint(h5) as ckpt:  # an error at open or at the first read
            for info in ckpt.tensors():
                ckpt.load(info.name)
            ckpt.training_state()
    members = _members(tiny["keras"])
    members["model.weights.h5"] = members["model.weights.h5"][:4096]
    path = _write_zip(tmp_path / "short.keras", list(members.items()))
    with pytest.raises(Fp8ExportError, match=r"short\.keras \(model\.weights\.h5\)"):
        open_checkpoint(path)


def test_missing_config_says_what_is_needed(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(Fp8ExportError, match=r"tiny\.weights\.h5.*config\.json.*to_json"):
        open_checkpoint(h5)
    members = _members(tiny["keras"])
    del members["config.json"]
    with pytest.raises(Fp8ExportError, match=r"no 'config\.json'"):
        open_checkpoint(_write_zip(tmp_path / "nocfg.keras", list(members.items())))


def test_float8_layer_with_wrong_history_shape(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)
    with h5py.File(h5, "r+") as f:
        group = f["layers/dense/vars"]  # "hidden": kernel, bias, then the six float8 vars
        assert group.attrs["name"] == "hidden"
        del group["3"]
        group["3"] = np.zeros((2, 512), np.float32)
    with pytest.raises(Fp8ExportError, match=r"layer 'hidden'.*histories"):
        open_checkpoint(h5)


def test_config_history_length_must_match(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)
    edit_config(tmp_path / "config.json", lambda cfg: layer_entry(cfg, "hidden")["config"][
        "dtype"]["config"].update(amax_history_length=16))
    with pytest.raises(Fp8ExportError, match=r"layer 'hidden'.*amax_history_length=16"):
        open_checkpoint(h5)


def test_all_non_finite_history_in_file_names_the_layer(tiny, tmp_path, capsys):
    """A layer whose every recorded step overflowed: convert exits 1 naming it, writes nothing."""
    from fp8export.cli import main

    h5 = copy_pair(tiny, tmp_path / "pair")
    with h5py.File(h5, "r+") as f:
        # "hidden" (kernel, bias, inputs_scale, inputs_amax_history, ...); "head" would be
        # kept in high precision as an output head and never asked for its history.
        assert f["layers/dense/vars"].attrs["name"] == "hidden"
        hist = f["layers/dense/vars/3"]
        hist[...] = np.where(hist[...] > 0, np.nan, 0).astype(np.float32)
    out = tmp_path / "out"
    code = main(["convert", str(h5), "-o", str(out), "--scales", "history"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "hidden" in err and "NaN/Inf" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "out" in p.name]


def test_absurd_nesting_is_refused(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)
    with h5py.File(h5, "r+") as f:
        f.create_group("layers/deep/" + "/".join(["g"] * 80))
    with pytest.raises(Fp8ExportError, match="nest deeper"):
        open_checkpoint(h5)


def test_links_out_of_the_file_are_refused(tiny, tmp_path):
    h5 = copy_pair(tiny, tmp_path)
    secret = tmp_path / "secret.h5"
    with h5py.File(secret, "w") as f:
        f["data"] = np.ones(3)
    with h5py.File(h5, "r+") as f:
        f["layers/stolen"] = h5py.ExternalLink(str(secret), "/")
    with pytest.raises(Fp8ExportError, match="ExternalLink"):
        open_checkpoint(h5)


def test_lambda_code_in_config_is_never_run(tiny, tmp_path):
    """A config naming code (Lambda) is only parsed: the payload would write a file."""
    marker = tmp_path / "pwned"
    members = _members(tiny["keras"])
    cfg = json.loads(members["config.json"])
    cfg["config"]["layers"].append({"module": "keras.layers", "class_name": "Lambda", "config": {
        "name": "evil", "function": {"class_name": "__lambda__", "config": {
            "code": f"open({str(marker)!r}, 'w').write('x')"}}}})
    members["config.json"] = json.dumps(cfg).encode()
    with open_checkpoint(_write_zip(tmp_path / "lambda.keras", list(members.items()))) as ckpt:
        assert ckpt.float8_modules()
        ckpt.training_state()
    assert not marker.exists()


def test_safezip_reads_within_bounds(tmp_path):
    path = _write_zip(tmp_path / "ok.zip", [("a.json", b"{}"), ("d/b.bin", b"12345")])
    with SafeZip(path) as zf:
        assert zf.read_bytes("d/b.bin", 10) == b"12345"
        with pytest.raises(Fp8ExportError, match="limit"):
            zf.read_bytes("d/b.bin", 4)
        with pytest.raises(Fp8ExportError, match="no 'missing'"):
            zf.read_bytes("missing", 10)


# ---- fuzz: random and truncated bytes give Fp8ExportError, nothing else --------------------
# (the Keras probe's child forked from a warm server: conftest's warm_keras_probe)
def _open_all(path: Path) -> None:
    with open_checkpoint(path) as ckpt:
        for info in ckpt.tensors():
            ckpt.load(info.name)
        ckpt.training_state()


FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=4096), suffix=st.sampled_from([".keras", ".weights.h5"]))
def test_fuzz_random_bytes(tmp_path_factory, warm_keras_probe, data, suffix):
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / f"m{suffix}"
    path.write_bytes(data)
    (folder / "config.json").write_text('{"class_name": "Functional", "config": {"layers": []}}')
    try:
        _open_all(path)
    except Fp8ExportError:
        pass


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(["Dense", "EinsumDense", "QuantizedFloat8DTypePolicy", "float8_from_x",
                       "hidden", "head", "mha", "layers", "config", "dtype", "name"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["class_name", "config", "layers", "name", "dtype", "mode",
                         "amax_history_length", "equation", "scale", "center"]), inner,
        max_size=5),
    max_leaves=30)


@FUZZ
@given(config=_JSON)
def test_fuzz_config_json(tiny, tmp_path_factory, warm_keras_probe, config):
    """Any JSON beside real float8 weights: the reader either copes or says why, never crashes."""
    folder = tmp_path_factory.mktemp("cfg")
    h5 = copy_pair(tiny, folder)
    (folder / "config.json").write_text(json.dumps(config))
    try:
        _open_all(h5)
    except Fp8ExportError:
        pass


@FUZZ
@given(cut=st.floats(0.0, 0.999))
def test_fuzz_truncated_keras(tiny, tmp_path_factory, warm_keras_probe, cut):
    data = tiny["keras"].read_bytes()
    path = tmp_path_factory.mktemp("trunc") / "m.keras"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(Fp8ExportError):
        _open_all(path)


@FUZZ
@given(cut=st.floats(0.0, 0.999))
def test_fuzz_truncated_member(tiny, tmp_path_factory, warm_keras_probe, cut):
    members = _members(tiny["keras"])
    h5 = members["model.weights.h5"]
    members["model.weights.h5"] = h5[: int(len(h5) * cut)]
    path = _write_zip(tmp_path_factory.mktemp("trunc-member") / "m.keras", list(members.items()))
    with pytest.raises(Fp8ExportError):
        _open_all(path)


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 0.999), st.integers(1, 255)), min_size=1,
                      max_size=8))
def test_fuzz_flipped_zip_bytes(tiny, tmp_path_factory, warm_keras_probe, flips):
    """Corrupt the archive's headers (not the HDF5 payload): errors are ours, not zipfile's."""
    raw = bytearray(tiny["keras"].read_bytes())
    start = raw.find(b"PK\x01\x02")  # central directory
    for pos, xor in flips:
        i = start + int((len(raw) - start) * pos)
        raw[i] ^= xor
    path = tmp_path_factory.mktemp("flip") / "m.keras"
    path.write_bytes(bytes(raw))
    try:
        _open_all(path)
    except Fp8ExportError:
        pass


def test_weights_file_that_crashes_hdf5_is_refused(tmp_path):
    """A .weights.h5 the exploring fuzz pass found (tests/reliability/test_fuzz.py) on which
    HDF5 segfaults: opening it ends in one Fp8ExportError naming the file and the crash (the
    walk runs in a child process first: fp8export.checkpoint.keras_probe). Run as a separate
    process so a regression fails this test only."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent / "hostile"
    (tmp_path / "m.weights.h5").write_bytes((here / "attr_segfault.weights.h5").read_bytes())
    (tmp_path / "config.json").write_bytes((here / "attr_segfault.config.json").read_bytes())
    code = ("import sys\n"
            "from fp8export.checkpoint.source import open_checkpoint\n"
            "from fp8export.errors import Fp8ExportError\n"
            "try:\n"
            "    with open_checkpoint(sys.argv[1]) as c:\n"
            "        [c.load(t.name) for t in c.tensors()]\n"
            "except Fp8ExportError as exc:\n"
            "    print('refused:', exc)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.weights.h5")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "m.weights.h5" in r.stdout, (r.returncode, r.stderr[-500:])
    assert "crashed the HDF5 library (SIGSEGV" in r.stdout, r.stdout


def test_probe_turns_a_hang_into_an_error(tiny, tmp_path, monkeypatch):
    """A walk that does not finish in time is refused too (the child is killed)."""
    from fp8export.checkpoint import keras_probe

    monkeypatch.setattr(keras_probe, "TIMEOUT_S", 0.001)
    with pytest.raises(Fp8ExportError, match="did not finish"):
        open_checkpoint(tiny["keras"])


def test_probe_that_cannot_start_is_one_error(tiny, monkeypatch):
    """No child process (a process limit): one Fp8ExportError naming the file, not a crash."""
    import subprocess

    def refuse(*a, **k):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "run", refuse)
    with pytest.raises(Fp8ExportError, match="could not start the separate process"):
        open_checkpoint(tiny["keras"])
