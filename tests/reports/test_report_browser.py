"""report.html laid out by a real browser (headless Chromium, skipped where none is installed):
no overlapping labels, no label inside a plot, no legend over a plot, no empty panel, no
horizontal overflow, and no script from the data."""

from __future__ import annotations

import pytest
from browser import chromium, layout_problems, measure

from fp8export.api import verify
from fp8export.verify.config import VerifyConfig

pytestmark = pytest.mark.skipif(chromium() is None, reason="needs Chromium (apt install chromium)")


@pytest.fixture(scope="module")
def damaged_report(tiny_llama, damaged_fp8, eval_npz, tmp_path_factory):
    from fp8export.errors import VerificationFailed

    out = tmp_path_factory.mktemp("browser-report")
    with pytest.raises(VerificationFailed):
        verify(VerifyConfig(reference=tiny_llama, candidate=damaged_fp8, data=eval_npz,
                            per_layer=True, report_dir=out))
    return out / "report.html"


@pytest.mark.parametrize("width", [1200, 640])
def test_report_reads_cleanly_in_a_browser(damaged_report, width):
    layout = measure(damaged_report, width)
    assert layout_problems(layout) == []
    titles = [f["title"] for f in layout["figures"]]
    assert titles == ["Where the error enters", "Per-token divergence", "Logits"]
    assert sum(len(f["panels"]) for f in layout["figures"]) == 4
    assert layout["scripts"] == 1  # the measuring script only


def test_untrusted_text_stays_text_in_a_browser(tmp_path):
    from test_report import EVIL, _result, _with_header

    from fp8export.reports.html import html_report

    page = tmp_path / "report.html"
    page.write_text(html_report(_with_header(_result())), encoding="utf-8")
    layout = measure(page)
    assert layout["scripts"] == 1 and layout_problems(layout) == []
    assert "alert(1)" in EVIL


def test_the_checker_catches_a_bad_layout(tmp_path):
    """Two labels on top of each other, a legend over the plot, a panel with no marks."""
    bad = tmp_path / "bad.svg"
    bad.write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" width="300" height="200"><title>bad</title>'
        '<text x="10" y="20" font-size="12">overlapping label</text>'
        '<text x="20" y="24" font-size="12">another label</text>'
        '<g id="f-panel-0"><g id="f-panel-0-title"><text x="10" y="190">empty</text></g>'
        '<g id="f-panel-0-plot-area"><rect x="50" y="50" width="200" height="100"/></g>'
        '<g id="f-panel-0-legend"><text x="60" y="70" font-size="11">legend</text></g>'
        '</g></svg>')
    problems = layout_problems(measure(bad))
    assert any("overlaps" in p for p in problems)
    assert any("legend covers a plot area" in p for p in problems)
    assert any("lies inside a plot area" in p for p in problems)
    assert any("is empty" in p for p in problems)
