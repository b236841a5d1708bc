"""The SVG renderer: valid XML, labels that never overlap or enter a plot, honest axes,
empty panels dropped, untrusted labels escaped."""

import math
import xml.etree.ElementTree as ET

import pytest

from fp8export.plots.figure import Axis, Band, Cells, Figure, Panel, RefLine, Series, layer_and_kind
from fp8export.plots.scale import fmt_number, linear_domain, log_domain
from fp8export.plots.svg import render, to_svg
from fp8export.plots.text import Box, text_width, wrap

SVG = "{http://www.w3.org/2000/svg}"


def _crowded_figure(n_series=9, layers=40):
    series = [Series(f"model.layers.N.self_attn.very_long_projection_name_{k}",
                     list(range(layers)), [1e-4 * (1 + k + 0.1 * i) for i in range(layers)],
                     marker="square") for k in range(n_series)]
    sqnr = [Series(f"kind {k}", list(range(layers)), [31.0 + 0.05 * k] * layers)
            for k in range(n_series)]
    return Figure("A title long enough to wrap onto a second line when the figure is narrow, "
                  "which it is here", [
                      Panel("scales", Axis("layer",
                                           ticks=[(i, f"layer {i}") for i in range(layers)]),
                            Axis("scale (log)", log=True), series),
                      Panel("empty", Axis("layer"), Axis("nothing"), [Series("none", [], [])]),
                      Panel("sqnr", Axis("layer"), Axis("dB", include=(0.0,)), sqnr,
                            bands=[Band(31.5, 32.5, "E4M3")],
                            lines=[RefLine(20.0, "a bound", axis="y")]),
                  ], ["a note " * 30], width=520, share_x=True)


def _overlaps(boxes):
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


def test_layout_keeps_labels_apart_and_out_of_the_plots():
    r = render(_crowded_figure())
    ET.fromstring(r.svg)  # well-formed XML
    assert _overlaps(r.text_boxes) == []
    for b in r.text_boxes:
        assert 0 <= b.x0 and b.x1 <= r.width and 0 <= b.y0 and b.y1 <= r.height, b
        assert not any(b.overlaps(area) for area in r.plot_areas), b
    assert len(r.plot_areas) == 2  # the empty panel is left out


def test_crowded_ticks_are_thinned_not_overlapped():
    r = render(_crowded_figure(layers=200))
    ticks = ET.fromstring(r.svg).findall(f".//{SVG}text[@class='tick']")
    shown = [t.text for t in ticks if t.text.startswith("layer")]
    assert 2 <= len(shown) < 200 and _overlaps(r.text_boxes) == []


def test_empty_figure_is_not_drawn():
    fig = Figure("t", [Panel("p", Axis("x"), Axis("y"), [Series("s", [1.0], [math.nan])])])
    assert fig.drawable() is None
    assert _crowded_figure().drawable().panels[1].title == "sqnr"


def test_axis_starts_at_zero_when_asked_and_includes_bands():
    svg = to_svg(Figure("t", [Panel("p", Axis("x"), Axis("dB", include=(0.0,)),
                                    [Series("s", [0, 1, 2], [31.4, 31.5, 31.6])],
                                    bands=[Band(29.5, 32.5, "band")])]))
    ticks = [t.text for t in ET.fromstring(svg).findall(f".//{SVG}text[@class='tick']")]
    assert "0" in ticks  # 31.4-31.6 dB is not stretched over the whole axis
    lo, hi, _, _ = linear_domain(31.4, 31.6, 5, (0.0, 32.5))
    assert lo == 0.0 and hi >= 32.5


def test_untrusted_labels_are_escaped():
    evil = "</text><script>alert(1)</script>&"
    svg = to_svg(Figure(evil, [Panel(evil, Axis(evil), Axis(evil), [Series(evil, [1], [1])])],
                        [evil]))
    root = ET.fromstring(svg)
    assert "<script" not in svg and root.find(f".//{SVG}script") is None
    assert any(t.text == evil for t in root.iter(f"{SVG}text"))


def test_square_panel_shares_one_domain_and_keeps_ticks_inside():
    cells = Cells([-9.0, 0.0, 47.0], [-13.0, 0.0, 3.0], [[3, 1], [1, 100]])
    r = render(Figure("t", [Panel("a", Axis("x"), Axis("y"), cells=cells, square=True),
                            Panel("b", Axis("x"), Axis("y"), cells=cells)], width=540))
    assert _overlaps(r.text_boxes) == []
    square, below = r.plot_areas
    assert square.x1 - square.x0 == pytest.approx(square.y1 - square.y0)
    assert below.x1 - below.x0 == pytest.approx(square.x1 - square.x0)  # aligned under it
    for b in r.text_boxes:  # every label beside its plot, none beyond the figure
        assert not any(b.overlaps(a) for a in r.plot_areas) and b.y1 <= r.height


def test_density_cells_and_histograms_draw_marks():
    cells = Cells([0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [[3, 0], [1, 100]])
    fig = Figure("t", [Panel("density", Axis("x"), Axis("y"), cells=cells, square=True),
                       Panel("hist", Axis("x", log=True), Axis("n", include=(0.0,)),
                             [Series("h", [1e-6, 1e-4, 1e-2], [5.0, 0.0], kind="hist")],
                             lines=[RefLine(0.02, "threshold")])])
    root = ET.fromstring(to_svg(fig))
    panels = root.findall(f".//{SVG}g[@class='panel']")
    marks = [len(p.findall(".//*[@class='mark']")) for p in panels]
    assert marks == [3, 1]  # three non-empty cells; one non-empty bin


@pytest.mark.parametrize(("lo", "hi"), [(1e-4, 3e-4), (2e-9, 0.5), (0.01, 0.011)])
def test_log_ticks_cover_the_data(lo, hi):
    a, b, ticks = log_domain(lo, hi)
    assert a <= lo and b >= hi and len(ticks) >= 2
    assert [v for v, _ in ticks] == sorted(v for v, _ in ticks)


def test_number_labels():
    assert fmt_number(-0.0, 0.5) == "0.0" and fmt_number(-1e-17, 1.0) == "0"
    assert fmt_number(-5.0, 5.0) == "−5"
    assert fmt_number(0.25, 0.05) == "0.25" and fmt_number(30.0, 10.0) == "30"


def test_text_measure_and_wrap():
    assert text_width("iiii", 10) < text_width("MMMM", 10)
    assert text_width("漢字", 10) == pytest.approx(20.0)
    lines = wrap("a " * 50 + "averyveryverylongtokenwithoutspaces" * 3, 11, 120)
    assert all(text_width(line, 11) <= 120 for line in lines)
    assert "".join(lines).replace(" ", "").endswith("spaces")
    assert Box(0, 0, 10, 10).overlaps(Box(9, 9, 20, 20))
    assert not Box(0, 0, 10, 10).overlaps(Box(10, 0, 20, 10))


def test_layer_and_kind():
    assert layer_and_kind("model.layers.3.self_attn.q_proj") == (3, "self_attn.q_proj")
    moe = "model.layers.2.mlp.experts.7.down_proj"
    assert layer_and_kind(moe) == (2, "mlp.experts.7.down_proj")
    assert layer_and_kind("fc1") == (None, "fc1")
