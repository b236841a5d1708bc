"""Charts drawn by matplotlib: reproducible SVG with text kept as text and ids unique per
figure, untrusted labels escaped, empty panels dropped, crowded ticks thinned, PNG too."""

import math
import xml.etree.ElementTree as ET

from fp8export.plots.figure import Axis, Band, Cells, Figure, Panel, RefLine, Series, layer_and_kind
from fp8export.plots.mpl import MAX_TICKS, png_bytes, svg_text

SVG = "{http://www.w3.org/2000/svg}"


def _figure(layers=8, title="scales"):
    series = [Series(f"kind {k}", list(range(layers)), [1e-4 * (1 + k + 0.1 * i)
                                                       for i in range(layers)], marker="square")
              for k in range(3)]
    ticks = [(i, f"layer {i}") for i in range(layers)]
    return Figure(title, [
        Panel("scales", Axis("layer", ticks=ticks), Axis("scale (log)", log=True), series),
        Panel("empty", Axis("layer"), Axis("nothing"), [Series("none", [], [])]),
        Panel("sqnr", Axis("layer"), Axis("dB", include=(0.0,)),
              [Series("s", [0, 1, 2], [31.4, 31.5, 31.6])], bands=[Band(29.5, 32.5, "E4M3")],
              lines=[RefLine(20.0, "a bound", axis="y")]),
    ], ["a note " * 30])


def _ids(root, suffix):
    return [g for g in root.iter(f"{SVG}g") if g.get("id", "").endswith(suffix)]


def test_svg_is_reproducible_accessible_and_keeps_text():
    svg = svg_text(_figure(), "a")
    assert svg == svg_text(_figure(), "a")  # same figure, same bytes: no date, fixed hash salt
    root = ET.fromstring(svg)
    assert root.get("role") == "img" and root.find(f"{SVG}title").text == "scales"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "sqnr" in texts and "a bound" in texts  # text, not glyph outlines
    assert len(_ids(root, "-plot-area")) == 2  # the empty panel is left out
    assert len(_ids(root, "-panel-0-mark-2")) == 1  # three series drawn in the first panel
    ids = [e.get("id") for e in root.iter() if e.get("id")]
    assert all(i.startswith("a-") for i in ids) and len(ids) == len(set(ids))


def test_two_figures_share_no_id():
    ids = [{e.get("id") for e in ET.fromstring(svg_text(_figure(), p)).iter() if e.get("id")}
           for p in ("fig0", "fig1")]
    assert not ids[0] & ids[1]


def test_axis_starts_at_zero_when_asked_and_crowded_ticks_are_thinned():
    root = ET.fromstring(svg_text(_figure(layers=200), "t"))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    shown = [t for t in texts if t.startswith("layer ")]
    assert 2 <= len(shown) <= MAX_TICKS
    assert "0" in texts  # 31.4-31.6 dB is not stretched over the whole axis


def test_untrusted_labels_are_escaped():
    evil = "</text><script>alert(1)</script>&"
    svg = svg_text(Figure(evil, [Panel(evil, Axis(evil), Axis(evil), [Series(evil, [1], [1])])],
                          [evil]))
    root = ET.fromstring(svg)
    assert "<script" not in svg and root.find(f".//{SVG}script") is None
    assert any(t.text == evil for t in root.iter(f"{SVG}text"))


def test_empty_figure_is_not_drawn():
    fig = Figure("t", [Panel("p", Axis("x"), Axis("y"), [Series("s", [1.0], [math.nan])])])
    assert fig.drawable() is None
    assert _figure().drawable().panels[1].title == "sqnr"


def test_density_cells_histograms_and_png():
    cells = Cells([0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [[3, 0], [1, 100]])
    fig = Figure("t", [Panel("density", Axis("x"), Axis("y"), cells=cells, square=True),
                       Panel("hist", Axis("x", log=True), Axis("n", include=(0.0,)),
                             [Series("h", [1e-6, 1e-4, 1e-2], [5.0, 0.0], kind="hist")],
                             lines=[RefLine(0.02, "threshold")])])
    root = ET.fromstring(svg_text(fig, "d"))
    density, hist = _ids(root, "-panel-0")[0], _ids(root, "-panel-1")[0]
    assert density.find(f".//{SVG}image") is not None  # the cells, as one raster image
    assert len(_ids(hist, "-panel-1-mark-0")) == 1
    png = png_bytes(fig)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == png_bytes(fig)


def test_layer_and_kind():
    assert layer_and_kind("model.layers.3.self_attn.q_proj") == (3, "self_attn.q_proj")
    moe = "model.layers.2.mlp.experts.7.down_proj"
    assert layer_and_kind(moe) == (2, "mlp.experts.7.down_proj")
    assert layer_and_kind("fc1") == (None, "fc1")
