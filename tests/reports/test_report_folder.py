"""The report folder follows convert's output rules: a report file saved during the run is not
replaced without --force, two runs never share one folder silently, and a full disk leaves the
earlier report whole (never half of a new one, never none)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.reports import report as report_mod
from fp8export.reports.report import REPORT_FILES, claimed_report_dir, verify_and_report
from fp8export.verify import run as run_mod
from fp8export.verify.config import VerifyConfig
from fp8export.verify.result import VerifyResult

sys.path.insert(0, str(Path(__file__).parent))
from test_report import _result  # noqa: E402


def _verify_result(notes_bytes: int = 0) -> VerifyResult:
    d = _result()
    names = {f.name for f in dataclasses.fields(VerifyResult)}
    res = VerifyResult(**{k: v for k, v in d.items() if k in names})
    res.passed, res.failures = True, []
    res.notes = ["x" * notes_bytes] if notes_bytes else res.notes
    return res


def _cfg(tmp_path, report_dir, **kw) -> VerifyConfig:
    return VerifyConfig(reference=tmp_path / "ref", candidate=tmp_path / "cand",
                        report_dir=report_dir, **kw)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_report_saved_during_the_run_is_not_replaced(tmp_path, monkeypatch):
    out = tmp_path / "rep"

    def verify(cfg):  # the user saves a report.md of their own while verify runs
        (out / "report.md").write_text("my notes")
        return _verify_result()

    monkeypatch.setattr(run_mod, "verify", verify)
    with pytest.raises(Fp8ExportError, match=r"report\.md: appeared while fp8export was "
                                             r"working.*--force"):
        verify_and_report(_cfg(tmp_path, out))
    assert (out / "report.md").read_text() == "my notes"
    assert _listing(out) == ["report.md"]  # none of the run's four, no temporaries


def test_force_replaces_the_saved_file_with_the_whole_set(tmp_path, monkeypatch):
    out = tmp_path / "rep"

    def verify(cfg):
        (out / "report.md").write_text("my notes")
        return _verify_result()

    monkeypatch.setattr(run_mod, "verify", verify)
    verify_and_report(_cfg(tmp_path, out, force=True))
    assert _listing(out) == sorted(REPORT_FILES)
    assert (out / "report.md").read_text().startswith("# fp8export verify")


def test_second_run_into_the_same_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    ran = []
    monkeypatch.setattr(run_mod, "verify", lambda cfg: ran.append(cfg) or _verify_result())
    with claimed_report_dir(out, force=False):  # a first run holds the folder
        with pytest.raises(Fp8ExportError, match="another fp8export run is writing a verify "
                                                 "report there now"):
            verify_and_report(_cfg(tmp_path, out))
        assert ran == []
    verify_and_report(_cfg(tmp_path, out))  # once the first run ends, the folder is free
    assert _listing(out) == sorted(REPORT_FILES)


def test_second_cli_run_exits_1_naming_the_folder(tmp_path):
    """Two processes: the first holds the report folder, the second is refused at its start."""
    out = tmp_path / "rep"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from fp8export.reports.report import claimed_report_dir\n"
         f"with claimed_report_dir({str(out)!r}, False):\n"
         "    print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        run = subprocess.run([sys.executable, "-m", "fp8export.cli", "verify",
                              str(tmp_path / "ref"), str(tmp_path / "cand"), "--report-dir",
                              str(out)], capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("Error:")]
    assert run.returncode == 1, run.stderr
    assert len(errors) == 1 and "another fp8export run" in errors[0] and str(out) in errors[0]


def test_failed_run_removes_the_folder_it_created(tmp_path, monkeypatch):
    def verify(cfg):
        raise Fp8ExportError("bad input")

    monkeypatch.setattr(run_mod, "verify", verify)
    with pytest.raises(Fp8ExportError, match="bad input"):
        verify_and_report(_cfg(tmp_path, tmp_path / "new" / "rep"))
    assert not (tmp_path / "new" / "rep").exists()


# A size-limited tmpfs gives a real ENOSPC; the earlier report fits, the new one does not.
@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({r.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_force_on_a_full_disk_keeps_the_earlier_report(small_disk):
    out = small_disk / "rep"
    report_mod.write_reports(_verify_result().to_dict(), out)
    before = {n: (out / n).read_bytes() for n in REPORT_FILES}
    # report.json and .md fit one at a time, .html no longer does: a writer that replaces
    # file by file has replaced two files by then
    big = _verify_result(notes_bytes=90_000)
    with pytest.raises(Fp8ExportError) as err:
        report_mod.write_reports(big.to_dict(), out, force=True)
    assert "No space left" in str(err.value) and "nothing was written" in str(err.value)
    assert {n: (out / n).read_bytes() for n in REPORT_FILES} == before
    assert _listing(out) == sorted(REPORT_FILES)
    assert json.loads(before["report.json"])["passed"] is True
    assert os.statvfs(small_disk).f_bfree > 0  # the staged files were removed again
