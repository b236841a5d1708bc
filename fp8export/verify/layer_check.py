"""The layer check: every quantized layer's own error, so one broken layer cannot hide.

The logits of a whole model can absorb one wrong layer: a weight scale 2x off in one of 42
layers moves the sample LM's KL by less than the gate allows (docs/verify.md, "Evidence"). So
for an FP8-folder candidate verify also measures each quantized linear's **isolated SQNR**
(``analysis/per_layer.py``: the FP8 layer fed the reference's own input, against the
reference layer's output) and gates on the worst one: ``layer_sqnr_min`` (dB, a minimum, in
every preset). A scale ``f`` times too large or small gives ``-20·log10|f − 1|`` dB whatever
the data: 0 dB at 2x, 6 dB at 0.5x, -17 dB at 8x; E4M3 rounding alone gives about 30 dB.

The check runs on the first :data:`CHECK_TOKENS` real tokens of the data (every batch with
``--per-layer``, and for MoE until each expert has been routed a token or the data ends), so it
costs a fraction of one extra candidate forward. An ONNX graph or an engine has no layers to
hook: the check is skipped there (verify the folder it was exported from).
"""

from __future__ import annotations

from typing import Any

METRIC = "layer_sqnr_min"
# Real tokens the default check measures on: E4M3 noise averaged over 2,048 tokens x every
# output feature is stable to a few tenths of a dB, and a wrong scale shows on any token.
CHECK_TOKENS = 2048
LISTED = 5  # layers named in a failure message


def measured(rows: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The rows that have an SQNR (an expert no token was routed to has none), worst first."""
    return sorted((r for r in rows or [] if r.get("sqnr_db") is not None),
                  key=lambda r: (r["sqnr_db"], r["order"]))


def layer_metrics(rows: list[dict[str, Any]] | None) -> dict[str, float]:
    """``{METRIC: worst isolated SQNR}``, or nothing when no layer was measured."""
    got = measured(rows)
    return {METRIC: float(got[0]["sqnr_db"])} if got else {}


def name_layers(checks: list[dict[str, Any]], rows: list[dict[str, Any]] | None,
                kind: str) -> None:
    """Say which layers the layer check is about, in place: a failed check names every layer
    below its bound (worst first), a passed one the worst layer, a skipped one why."""
    for check in checks:
        if check.get("metric") != METRIC:
            continue
        if check["status"] == "skipped":
            check["message"] = (
                f"{METRIC} needs an FP8 folder as the candidate (its layers are hooked; got a "
                f"{kind}): verify the folder it was exported from for the layer check")
            continue
        got = measured(rows)
        bound = check["threshold"]
        below = [r for r in got if not r["sqnr_db"] >= bound]
        shown = below or got[:1]
        where = ", ".join(f"{r['module']} ({r['sqnr_db']:.1f} dB)" for r in shown[:LISTED])
        more = f" and {len(shown) - LISTED} more" if len(shown) > LISTED else ""
        check["layers"] = [r["module"] for r in below]
        if below:
            check["message"] = (
                f"{METRIC} = {got[0]['sqnr_db']:.1f} dB (needs >= {bound:g} dB): "
                f"{len(below)} of {len(got)} quantized layer(s) below it: {where}{more}; "
                "its weight or input scale is likely wrong (--per-layer ranks every layer)")
        else:
            check["message"] = (f"{METRIC} = {got[0]['sqnr_db']:.1f} dB (needs >= {bound:g} "
                                f"dB): worst layer {where}")


def summary(rows: list[dict[str, Any]] | None, tokens: int, bound: float | None
            ) -> dict[str, Any] | None:
    """What the layer check measured, for report.json ``layer_check``: the bound, the tokens,
    the layers measured and not, and the worst few."""
    if rows is None:
        return None
    got = measured(rows)
    return {"metric": METRIC, "threshold": bound, "tokens": tokens, "layers": len(rows),
            "measured": len(got),
            "unmeasured": [r["module"] for r in rows if r.get("sqnr_db") is None],
            "worst": [{"module": r["module"], "sqnr_db": r["sqnr_db"]} for r in got[:LISTED]]}


def unmeasured_note(rows: list[dict[str, Any]] | None) -> str | None:
    """A note when some layers (MoE experts no token was routed to) could not be checked."""
    missing = [r["module"] for r in rows or [] if r.get("sqnr_db") is None]
    if not missing:
        return None
    shown = ", ".join(missing[:LISTED]) + (f" and {len(missing) - LISTED} more"
                                           if len(missing) > LISTED else "")
    return (f"The layer check could not measure {len(missing)} quantized layer(s): no token of "
            f"the data was routed to them ({shown}). Give more or more varied --data to check "
            "every expert.")
