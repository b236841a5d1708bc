"""Headless Chromium for tests and screenshots: lay a page out in a real browser and measure it.

No driver or Python package: ``chromium --headless --dump-dom`` loads a copy of the page with
a small measuring script appended, and the script writes what it measured (every SVG text
box, plot area, legend and panel, found by the ids ``fp8export.plots.mpl`` gives them) into
the DOM that Chromium prints. ``--screenshot`` takes
pictures. ``chromium()`` is None when no browser is installed (tests skip).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio")
TIMEOUT_S = 90

# Appended to a copy of the page: measures after layout, writes JSON into <pre id=...>.
_MEASURE = """<script>
(() => {
  const box = e => { const r = e.getBoundingClientRect();
                     return [r.left, r.top, r.right, r.bottom]; };
  const ids = (root, re) => [...root.querySelectorAll('g[id]')].filter(g => re.test(g.id));
  const figures = [...document.querySelectorAll('svg')].map(svg => ({
    box: box(svg),
    title: (svg.querySelector('title') || {}).textContent || '',
    texts: [...svg.querySelectorAll('text')].map(t => ({text: t.textContent, box: box(t)})),
    plotAreas: ids(svg, /-plot-area$/).map(box),
    legends: ids(svg, /-legend$/).map(box),
    panels: ids(svg, /-panel-\\d+$/).map(p => ({
      title: ((ids(p, /-title$/)[0] || {}).textContent || '').trim(),
      marks: ids(p, /-mark-\\d+$/).length + p.querySelectorAll('image').length})),
  }));
  const out = document.createElement('pre');
  out.id = 'fp8export-layout';
  out.textContent = JSON.stringify({figures, scripts: document.scripts.length,
    scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth,
    height: document.documentElement.scrollHeight});
  document.body.appendChild(out);
})();
</script>"""


def chromium() -> str | None:
    """The Chromium executable (``$CHROMIUM`` or on PATH), or None."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run(args: list[str]) -> str:
    exe = chromium()
    if exe is None:
        raise RuntimeError("Chromium is not installed")
    with tempfile.TemporaryDirectory(prefix="fp8export-chromium-") as profile:
        proc = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


# Appended for a picture of part of a page: keeps the body's children from the element with
# id START up to (not including) the one with id STOP.
_PART = """<script>
(() => { const a = document.getElementById(%s), b = document.getElementById(%s);
         while (a && a.previousElementSibling) a.previousElementSibling.remove();
         while (b && b.nextElementSibling) b.nextElementSibling.remove();
         if (b) b.remove(); })();
</script>"""


def _page(path: Path, start: str | None = None, stop: str | None = None,
          measuring: bool = True) -> Path:
    """A copy of ``path`` (an SVG is wrapped in HTML), cut to the part from the element with
    id ``start`` to the one with id ``stop``, with the measuring script."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix.lower() == ".svg":
        text = f"<!DOCTYPE html><html><body style='margin:0'>{text}</body></html>"
    script = ((_PART % (json.dumps(start), json.dumps(stop)) if start or stop else "")
              + (_MEASURE if measuring else ""))
    tmp = Path(tempfile.mkdtemp(prefix="fp8export-page-")) / "page.html"
    tmp.write_text(text.replace("</body>", script + "</body>"), encoding="utf-8")
    return tmp


def measure(path: Path, width: int = 1200, start: str | None = None,
            stop: str | None = None) -> dict:
    """Lay ``path`` (HTML or SVG; ``start``/``stop``: see ``_page``) out at ``width`` px and
    return the measurements."""
    page = _page(path, start, stop)
    try:
        dom = _run([f"--window-size={width},1000", "--virtual-time-budget=5000", "--dump-dom",
                    page.as_uri()])
    finally:
        shutil.rmtree(page.parent, ignore_errors=True)
    m = re.search(r'<pre id="fp8export-layout">(.*?)</pre>', dom, re.S)
    if m is None:
        raise RuntimeError("the measuring script did not run; chromium printed:\n" + dom[:2000])
    import html

    return json.loads(html.unescape(m.group(1)))


def screenshot(path: Path, png: Path, width: int = 1200, start: str | None = None,
               stop: str | None = None) -> None:
    """A PNG of ``path`` (HTML or SVG) ``width`` px wide: the whole page, or the part from the
    element with id ``start`` up to the one with id ``stop``."""
    height = int(measure(path, width, start, stop)["height"])
    page = _page(path, start, stop, measuring=False)
    try:
        _run([f"--window-size={width},{height}", f"--screenshot={Path(png).resolve()}",
              "--virtual-time-budget=5000", page.as_uri()])
    finally:
        shutil.rmtree(page.parent, ignore_errors=True)


def _overlap(a: list[float], b: list[float], tol: float) -> bool:
    return (min(a[2], b[2]) - max(a[0], b[0]) > tol) and (min(a[3], b[3]) - max(a[1], b[1]) > tol)


def layout_problems(layout: dict, tol: float = 0.5) -> list[str]:
    """Everything wrong with a measured page: overlapping labels, labels outside their figure
    or inside a plot area, a legend over a plot, a panel without marks, horizontal overflow."""
    problems = []
    if layout["scrollWidth"] > layout["innerWidth"] + 1:
        problems.append(f"page overflows horizontally: {layout['scrollWidth']} px wide in a "
                        f"{layout['innerWidth']} px window")
    for fig in layout["figures"]:
        name = fig["title"] or "figure"
        texts = [t for t in fig["texts"] if t["text"].strip()]
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                if _overlap(a["box"], b["box"], tol):
                    problems.append(f"{name}: text {a['text']!r} overlaps {b['text']!r}")
            s = fig["box"]
            x0, y0, x1, y1 = a["box"]
            if x0 < s[0] - tol or y0 < s[1] - tol or x1 > s[2] + tol or y1 > s[3] + tol:
                problems.append(f"{name}: text {a['text']!r} sticks out of the figure")
            for area in fig["plotAreas"]:
                if _overlap(a["box"], area, tol):
                    problems.append(f"{name}: text {a['text']!r} lies inside a plot area")
        for legend in fig["legends"]:
            for area in fig["plotAreas"]:
                if _overlap(legend, area, tol):
                    problems.append(f"{name}: a legend covers a plot area")
        for panel in fig["panels"]:
            if panel["marks"] == 0:
                problems.append(f"{name}: panel {panel['title']!r} is empty")
    return problems
