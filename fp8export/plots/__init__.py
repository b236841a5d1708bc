"""Charts: the hand-drawn SVG renderer and the matplotlib backend the report and inspect use."""
