"""One rule for fused groups: every member uses the group's max."""

from __future__ import annotations

import math

from fp8export.scales.groups import group_max, share_max

GROUPS = {"qkv": ["q", "k", "v"], "gate_up": ["gate", "up"]}


def test_members_take_the_group_max_and_others_keep_theirs():
    got = share_max({"q": 1.0, "k": 3.0, "v": 2.0, "gate": 0.5, "o": 9.0}, GROUPS)
    assert got == {"q": 3.0, "k": 3.0, "v": 3.0, "gate": 0.5, "o": 9.0}  # up has none: none


def test_a_group_with_nan_or_inf_is_left_for_the_caller_to_report():
    values = {"q": 1.0, "k": math.nan, "v": 2.0, "gate": math.inf, "up": 1.0}
    got = share_max(values, GROUPS)
    assert got["q"] == 1.0 and got["v"] == 2.0 and got["up"] == 1.0


def test_group_max_of_members_with_values():
    assert group_max({"q": 1.0, "v": 4.0}, ["q", "k", "v"]) == 4.0
    assert group_max({"o": 1.0}, ["q", "k"]) is None
