"""Charts for the reports and inspect: the hand-drawn SVG renderer and the matplotlib backend
(imported lazily)."""
