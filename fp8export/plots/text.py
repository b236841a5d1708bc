"""Text measurement without a font engine: advance widths of DejaVu Sans, boxes, wrapping.

The layout must know how wide a label is to keep labels apart, and no font library is
installed by default. DejaVu Sans is the widest of the common sans-serif fonts (Verdana-like
metrics; Arial, Helvetica and Liberation Sans are narrower), and the SVG asks for it first,
so a layout that fits with these widths fits with whatever sans-serif font the viewer has.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

# Advance widths in 1/1000 em of DejaVu Sans (Book and Bold), characters 32..126, read from
# the font's hmtx table.
_REGULAR = (
    318, 401, 460, 838, 636, 950, 780, 275, 390, 390, 500, 838, 318, 361, 318, 337, 636, 636,
    636, 636, 636, 636, 636, 636, 636, 636, 337, 337, 838, 838, 838, 531, 1000, 684, 686, 698,
    770, 632, 575, 775, 752, 295, 295, 656, 557, 863, 748, 787, 603, 787, 695, 635, 611, 732,
    684, 989, 685, 611, 685, 390, 337, 390, 838, 500, 500, 613, 635, 550, 635, 615, 352, 635,
    634, 278, 278, 579, 278, 974, 634, 612, 635, 635, 411, 521, 392, 634, 592, 818, 592, 592,
    525, 636, 337, 636, 838)
_BOLD = (
    348, 456, 521, 838, 696, 1002, 872, 306, 457, 457, 523, 838, 380, 415, 380, 365, 696, 696,
    696, 696, 696, 696, 696, 696, 696, 696, 400, 400, 838, 838, 838, 580, 1000, 774, 762, 734,
    830, 683, 683, 821, 837, 372, 372, 775, 637, 995, 837, 850, 733, 850, 770, 720, 682, 812,
    774, 1103, 771, 724, 725, 457, 365, 457, 838, 500, 500, 675, 716, 593, 716, 678, 435, 716,
    712, 343, 343, 665, 343, 1042, 712, 687, 716, 716, 493, 595, 478, 712, 652, 924, 645, 652,
    582, 712, 365, 712, 838)
_OTHER = 840  # non-ASCII symbols in DejaVu Sans (≥, →, ✓, −, ×) are 838; accented letters less
_WIDE = 1000  # East Asian wide and full-width characters

# Vertical extent of a line of text around its baseline, in em: DejaVu Sans' ascender and
# descender, the box a browser reports for a text element (glyphs themselves reach 0.76).
ASCENT = 0.93
DESCENT = 0.24
FONT_FAMILY = "'DejaVu Sans', Verdana, 'Liberation Sans', Arial, Helvetica, sans-serif"


def text_width(text: str, size: float, bold: bool = False) -> float:
    """Width in px of ``text`` set in ``size`` px DejaVu Sans."""
    table = _BOLD if bold else _REGULAR
    total = 0
    for ch in text:
        code = ord(ch)
        if 32 <= code < 127:
            total += table[code - 32]
        elif unicodedata.combining(ch):
            continue
        elif unicodedata.east_asian_width(ch) in ("W", "F"):
            total += _WIDE
        else:
            total += _OTHER
    return total * size / 1000.0


def wrap(text: str, size: float, width: float, bold: bool = False) -> list[str]:
    """Greedy word wrap to ``width`` px; a word longer than a line is cut by characters."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if text_width(candidate, size, bold) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        line = ""
        while text_width(word, size, bold) > width:  # a very long token: hard cut
            cut = 1
            while cut < len(word) and text_width(word[:cut + 1], size, bold) <= width:
                cut += 1
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    if line:
        lines.append(line)
    return lines or [""]


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle in px (x right, y down)."""

    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: Box, gap: float = 0.0) -> bool:
        """True if the two boxes intersect, or come closer than ``gap`` px."""
        return (self.x0 < other.x1 + gap and other.x0 < self.x1 + gap
                and self.y0 < other.y1 + gap and other.y0 < self.y1 + gap)


def text_box(x: float, y: float, text: str, size: float, anchor: str = "start",
             bold: bool = False) -> Box:
    """The box of ``text`` drawn with its baseline at ``y`` and ``text-anchor`` at ``x``."""
    w = text_width(text, size, bold)
    x0 = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
    return Box(x0, y - ASCENT * size, x0 + w, y + DESCENT * size)
