"""Reports from a verification result: report.json, report.md, and the writer of all four.

The result is already plain data (see run.py); reporting only formats it. What the header
and the metric table show is defined once here (:func:`header_rows`, :data:`METRIC_GROUPS`)
and rendered by both Markdown and HTML, so a new header fact or metric family is one entry.
Non-finite floats are written to JSON as the strings "inf", "-inf" and "nan" so the file stays
strict JSON. Text from the data (worst samples) is untrusted: escaped for each format.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    from fp8export.verify.config import VerifyConfig
    from fp8export.verify.result import VerifyResult

JSON_KEYS_ORDER = ("passed", "backend", "samples", "metrics", "thresholds", "failures",
                   "per_layer", "header")
# Metric families in display order; a metric not named here is shown under "Other".
METRIC_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Logits", ("cosine_mean", "cosine_min", "cosine_token_min", "rel_l2", "max_abs",
                "prob_max_abs")),
    ("Predictions", ("top1_agreement", "top5_overlap", "kl_mean", "kl_p99", "kl_max")),
    ("Perplexity", ("ppl_reference", "ppl_candidate", "ppl_ratio")),
    ("Accuracy", ("accuracy_reference", "accuracy_candidate", "accuracy_drop")),
    ("Embeddings", ("neighbor_agreement",)),
    ("Layers", ("layer_sqnr_min",)),
    ("Counts", ("tokens", "ppl_tokens", "embedding_dim")),
)
METRIC_ORDER = tuple(k for _, keys in METRIC_GROUPS for k in keys)
SHORT_HASH = 12


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by strings, recursively (tuples become lists)."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def report_dict(result: dict[str, Any]) -> dict[str, Any]:
    """The content of report.json: the DESIGN.md keys first, then the rest (no raw plot data)."""
    out = {k: result.get(k) for k in JSON_KEYS_ORDER}
    for k, v in result.items():
        if k not in out and k != "distributions":
            out[k] = v
    return json_safe(out)


def format_value(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def format_db(v: Any) -> str:
    """A level in dB: one decimal is what the measurement supports."""
    return f"{v:.1f}" if isinstance(v, float) and math.isfinite(v) else format_value(v)


def _size(n: int | None) -> str:
    if not n:
        return "0 B"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# ------------------------------------------------------------------------ shared content

def metric_rows(metrics: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """``(family, metric, value)`` for every metric present, in :data:`METRIC_GROUPS` order."""
    rows = [(group, k, metrics[k]) for group, keys in METRIC_GROUPS for k in keys if k in metrics]
    named = set(METRIC_ORDER)
    rows += [("Other", k, v) for k, v in metrics.items() if k not in named]
    return rows


def _hash_text(entry: dict[str, Any]) -> str:
    digest = entry.get("sha256")
    if not digest:
        return "not hashed"
    files = entry.get("files") or []
    what = f"{len(files)} files, " if len(files) > 1 else ""
    skipped = entry.get("skipped") or []
    skip = f"; not read: {', '.join(skipped[:5])}{'…' if len(skipped) > 5 else ''}" \
        if skipped else ""
    return f"sha256 {digest[:SHORT_HASH]} ({what}{_size(entry.get('bytes'))}{skip})"


def header_rows(result: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """The report header as ``(label, text, code)`` rows; ``code`` (a path or command) is
    shown in monospace before ``text``. Old results without a header give the basics."""
    h = result.get("header") or {}
    ref, cand, data = h.get("reference") or {}, h.get("candidate") or {}, h.get("data") or {}
    ref_run, cand_run = result.get("reference") or {}, result.get("candidate") or {}
    rows: list[tuple[str, str, str | None]] = []
    if h.get("tool"):
        rows.append(("Tool", f"{h['tool'].get('name')} {h['tool'].get('version')}", None))
    if h.get("command"):
        rows.append(("Command", "", h["command"]))
    elif h:
        rows.append(("Command", "called from Python (fp8export.api.verify); options in "
                                "report.json", None))
    if h.get("created"):
        rows.append(("Date", h["created"].replace("T", " ").replace("+00:00", " UTC"), None))
    ref_bits = [ref.get("dtype") or ref_run.get("dtype"),
                f"{ref.get('backend') or ref_run.get('backend')} on "
                f"{ref.get('device') or ref_run.get('device') or '?'}"]
    if ref:
        ref_bits.append(_hash_text(ref))
    rows.append(("Reference", " — ".join(str(b) for b in ref_bits if b),
                 ref.get("path") or ref_run.get("path")))
    cand_bits = [cand.get("kind") or cand_run.get("kind"),
                 result.get("backend") + (f" ({cand.get('mode')})" if cand.get("mode") else "")]
    if cand:
        cand_bits.append(_hash_text(cand))
        match = cand.get("converted_from_reference")
        if match is True:
            cand_bits.append("converted from this reference (its manifest's source hashes "
                             "match)")
        elif match is False and cand.get("source_mismatch"):
            cand_bits.append("NOT converted from this reference: source files differ ("
                             + ", ".join(cand.get("source_mismatch") or []) + ")")
        if cand.get("edited_after_convert"):
            cand_bits.append("EDITED after convert: "
                             + ", ".join(cand["edited_after_convert"][:5])
                             + " differ from what convert wrote")
    rows.append(("Candidate", " — ".join(str(b) for b in cand_bits if b),
                 cand.get("path") or cand_run.get("path")))
    src = (result.get("data") or {}).get("source") or data.get("source")
    tokens = data.get("tokens") or (result.get("metrics") or {}).get("tokens")
    data_bits = [f"{result.get('samples')} samples" + (f", {tokens:,} tokens" if tokens else "")]
    if data.get("sha256"):
        data_bits.append(f"sha256 {data['sha256'][:SHORT_HASH]}")
    rows.append(("Data", " — ".join(data_bits), src))
    if h.get("device"):
        dev = h["device"] + (f" ({h['device_name']})" if h.get("device_name") else "")
        dtypes = h.get("dtype") or {}
        runtime = f" ({h['runtime']})" if h.get("runtime") else ""
        rows.append(("Backend", f"{h.get('backend')} on {dev}{runtime}; reference "
                                f"{dtypes.get('reference')}, candidate activations "
                                f"{dtypes.get('candidate') or 'as exported'}", None))
    family = result.get("family")
    if family:
        rows.append(("Judged by", f"{family} metrics", None))
    rows.append(("Thresholds", str(result.get("thresholds_source")), None))
    env = h.get("environment") or {}
    if env:
        rows.append(("Environment", ", ".join(f"{k} {v}" for k, v in env.items()
                                               if k != "platform")
                     + (f" — {env['platform']}" if env.get("platform") else ""), None))
    return rows


def threshold_text(check: dict[str, Any]) -> str:
    """A check's bound as shown: "≤ 0.02", or for a bound relative to the noise floor
    "≤ 10x floor (0.0123)"."""
    if check.get("op") is None:  # a rule without a bound: "at least one threshold applies"
        return str(check.get("name", ""))
    sym = "≥" if check["op"] == "min" else "≤"
    bound = check.get("threshold")
    if check.get("rule"):
        return f"{sym} {check['rule']}" + (f" ({bound:.4g})" if bound is not None else "")
    return f"{sym} {bound:g}"


def interval_text(check: dict[str, Any]) -> str:
    """A check's confidence interval as shown ("[0.0171, 0.0236] ⚠" when it holds the
    threshold), or "–" where none was computed."""
    iv = check.get("interval")
    if not iv:
        return "–"
    return f"[{format_value(iv[0])}, {format_value(iv[1])}]" + (
        "" if check.get("decided", True) else " ⚠")


def confidence_summary(result: dict[str, Any]) -> tuple[str, list[str]]:
    """``(one line, warnings)`` on how certain the verdict is (confidence.py); empty when the
    result has no intervals."""
    conf = result.get("confidence") or {}
    if not conf:
        return "", []
    head = (f"Verdict {conf['verdict']}: {conf['level']:.0%} intervals from {conf['resamples']} "
            f"bootstrap resamples of the {conf['samples']} samples ({conf['tokens']:,} tokens); "
            "⚠ marks a check whose interval holds its threshold.")
    return head, list(conf.get("warnings") or [])


def layer_check_text(result: dict[str, Any]) -> tuple[str, bool]:
    """``(one line, failed)`` on the layer check (layer_check.py); empty when it did not run."""
    lc = result.get("layer_check") or {}
    check = next((c for c in result.get("checks") or [] if c["metric"] == "layer_sqnr_min"), None)
    if not lc or check is None or check["status"] == "skipped":
        return "", False
    if check["status"] == "failed":
        return f"Layer check failed: {check['message']}.", True
    worst = (lc.get("worst") or [{}])[0]
    text = (f"Layer check: each of the {lc['measured']} quantized layers measured alone (its "
            f"output SQNR fed the reference's own input, {lc['tokens']:,} tokens) is at least "
            f"{check['threshold']:g} dB; the worst is {worst.get('module')} at "
            f"{format_db(worst.get('sqnr_db'))} dB.")
    if lc.get("unmeasured"):
        text += f" {len(lc['unmeasured'])} got no token (see the notes)."
    return text, False


def attention_cost_lines(result: dict[str, Any]) -> list[str]:
    """The "FP8 KV cache and attention" table of report.md (``--kv-cache``/``--attention
    fp8``): each configuration against the reference, with 95% intervals."""
    cost = result.get("attention_cost") or {}
    rows = cost.get("rows") or []
    if not rows:
        return []
    out = ["", "## What the FP8 KV cache and attention cost", "",
           "Each configuration against the reference on the same samples (95% bootstrap "
           "intervals over samples); the verdict judges the last.", "",
           "| configuration | kl_mean | top1_agreement | kl_p99 |", "|---|---|---|---|"]
    for r in rows:
        cells = []
        for k in ("kl_mean", "top1_agreement", "kl_p99"):
            span = r.get(f"{k}_interval")
            text = format_value(r.get(k))
            if span:
                text += f" [{format_value(span[0])}, {format_value(span[1])}]"
            cells.append(text)
        out.append(f"| {md_escape(r['configuration'])} | " + " | ".join(cells) + " |")
    return out


def noise_floor_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """``(metric, candidate, floor, candidate vs fp32, loss ratio)`` texts for the report."""
    floor = result.get("noise_floor") or {}
    return [(r["metric"], format_value(r["candidate"]), format_value(r["floor"]),
             format_value(r["candidate_vs_fp32"]),
             "–" if r["ratio"] is None else f"{r['ratio']:.1f}x")
            for r in floor.get("rows") or []]


NOISE_FLOOR_TITLE = "Noise floor: FP8's loss next to the {dtype} reference's own"
NOISE_FLOOR_HEAD = ("metric", "candidate vs reference", "reference vs fp32 (floor)",
                    "candidate vs fp32", "candidate loss / floor loss")
NOISE_FLOOR_TEXT = ("The reference runs in {dtype}; the same checkpoint run in fp32 on the same "
                    "inputs shows how much {dtype} alone moves its outputs. Loss is 1 − value "
                    "for similarities, value − 1 for ppl_ratio.")


def worst_sample_text(s: dict[str, Any]) -> tuple[str, str | None, str]:
    """``(context, token, predictions)`` of a worst-sample entry, display-safe whoever wrote it
    (controls and bidi characters visible, lengths bounded); still to be escaped per format."""
    from fp8export.verify.worst_samples import display_text

    s = {k: display_text(v, 400) if isinstance(v, str) else v for k, v in s.items()}
    if s.get("position") is not None:
        nxt = f"; actual next: “{s['next_token']}”" if s.get("next_token") is not None else ""
        pred = (f"reference “{s['reference_top1']}” ({_pct(s.get('reference_top1_p'))}), "
                f"candidate “{s['candidate_top1']}” ({_pct(s.get('candidate_top1_p'))}){nxt}")
        return s.get("context") or "", s.get("token"), pred
    pred = (f"reference {s.get('reference_top1')} ({_pct(s.get('reference_top1_p'))}), "
            f"candidate {s.get('candidate_top1')} ({_pct(s.get('candidate_top1_p'))})")
    return s.get("context") or "", None, pred


def _pct(p: Any) -> str:
    return f"{p:.0%}" if isinstance(p, (int, float)) and math.isfinite(p) else "?"


# ------------------------------------------------------------------------------ Markdown

_MD_SPECIAL = re.compile(r"([\\`*_\[\]!|~<>&])")


def md_escape(text: str) -> str:
    """Untrusted text as inert Markdown (GitHub renders HTML in report.md): every character
    that could start markup is escaped, and it stays on one line (table-safe)."""
    text = " ".join(str(text).split())
    return _MD_SPECIAL.sub(lambda m: {"<": "&lt;", ">": "&gt;", "&": "&amp;"}.get(
        m.group(1), "\\" + m.group(1)), text)


def md_code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds (table-safe)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (run + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown(result: dict[str, Any], max_layers: int = 10, max_samples: int = 5) -> str:
    """report.md: verdict, header, threshold checks, metrics, worst layers and samples, notes."""
    verdict = "✅ PASSED" if result["passed"] else "❌ FAILED"
    lines = [f"# fp8export verify: {verdict}", ""]
    for label, text, code in header_rows(result):
        value = " — ".join(x for x in (md_code(code) if code else "", md_escape(text)) if x)
        lines.append(f"- **{label}**: {value}")
    lines.append("")
    failed = [c for c in result["checks"] if c["status"] == "failed"]
    if failed:
        lines.append("**Failing metrics:** " + ", ".join(f"`{c['metric']}`" for c in failed))
        lines.append("")
    level = (result.get("confidence") or {}).get("level", 0.95)
    lines += [f"| check | value | {level:.0%} interval | threshold | result |",
              "|---|---|---|---|---|"]
    icon = {"passed": "✅ pass", "failed": "❌ FAIL", "skipped": "➖ n/a"}
    for c in result["checks"]:
        lines.append(f"| `{c['metric']}` | {format_value(c['value'])} | {interval_text(c)} | "
                     f"{threshold_text(c)} | {icon[c['status']]} |")
    head, warnings = confidence_summary(result)
    if head:
        lines += ["", f"**{md_escape(head)}**"] + [f"- ⚠ {md_escape(w)}" for w in warnings]
    layers_text, layers_failed = layer_check_text(result)
    if layers_text:
        lines += ["", ("❌ " if layers_failed else "") + md_escape(layers_text)]
    floor_rows = noise_floor_rows(result)
    if floor_rows:
        dtype = result["noise_floor"]["reference_dtype"]
        lines += ["", f"## {NOISE_FLOOR_TITLE.format(dtype=dtype)}", "",
                  NOISE_FLOOR_TEXT.format(dtype=dtype), "",
                  "| " + " | ".join(NOISE_FLOOR_HEAD) + " |", "|---|---|---|---|---|"]
        lines += [f"| `{m}` | {c} | {f} | {v} | {r} |" for m, c, f, v, r in floor_rows]
    lines += attention_cost_lines(result)
    lines += ["", "<details><summary>All metrics</summary>", "",
              "| family | metric | value |", "|---|---|---|"]
    for group, k, v in metric_rows(result["metrics"]):
        lines.append(f"| {group} | {md_code(k)} | {format_value(v)} |")
    lines += ["", "</details>", ""]
    layers = result.get("per_layer")
    if layers:
        lines += [f"## Per-layer error (worst {min(max_layers, len(layers))} of {len(layers)}, "
                  "isolated SQNR: each FP8 layer fed the reference's own input)", "",
                  "| rank | module | SQNR dB | end-to-end SQNR dB | saturated |",
                  "|---|---|---|---|---|"]
        for r in layers[:max_layers]:
            lines.append(f"| {r['rank']} | {md_code(r['module'])} | {format_db(r['sqnr_db'])} | "
                         f"{format_db(r['sqnr_e2e_db'])} | {r['saturated']:.2%} |")
        lines.append("")
    worst = (result.get("worst_samples") or [])[:max_samples]
    if worst:
        lines += [f"## Worst samples (largest mean KL; {len(worst)} shown)", "",
                  "| sample | KL mean | KL max at token | text → <b>token</b> | predictions |",
                  "|---|---|---|---|---|"]
        for s in worst:
            context, token, pred = worst_sample_text(s)
            # <b>, not **: emphasis markers do not work around a token's leading space
            shown = md_escape(context) + (f" → <b>{md_escape(token)}</b>" if token else "")
            kl = format_value(s.get("kl_max"))
            at = f"{kl} at {s['position']}" if s.get("position") is not None else kl
            lines.append(f"| {s['index']} | {format_value(s.get('kl_mean'))} | {at} | {shown} | "
                         f"{md_escape(pred)} |")
        lines.append("")
    for note in result.get("notes", []):
        lines.append(f"> {md_escape(note)}")
    return "\n".join(lines).rstrip() + "\n"


REPORT_FILES = ("report.json", "report.md", "report.html", "junit.xml")


def check_report_dir(report_dir: Path, force: bool, inputs=()) -> None:
    """Refuse, before any work, a ``--report-dir`` that is, holds or lies inside one of
    ``inputs`` (models, data, thresholds file), whose report files would replace an input or
    anything but a regular file, or replace a report without ``--force``."""
    from fp8export.io.outputs import check_file_target, probe_writable, refuse_overlap

    report_dir = Path(report_dir)
    option = "--report-dir"
    refuse_overlap(report_dir, inputs, option)
    if report_dir.exists() and not report_dir.is_dir() or report_dir.is_symlink():
        raise Fp8ExportError(f"{report_dir}: exists and is not a folder; --report-dir names the "
                             "folder the reports go into. Choose another --report-dir.")
    for name in REPORT_FILES:
        refuse_overlap(report_dir / name, inputs, option)
        if os.path.lexists(report_dir / name) and not (report_dir / name).is_symlink() \
                and (report_dir / name).is_file() and not force:
            present = [n for n in REPORT_FILES if (report_dir / n).exists()]
            raise Fp8ExportError(f"{report_dir}: already holds a verify report "
                                 f"({', '.join(present)}). Pass --force to replace it, or choose "
                                 "another --report-dir.")
        check_file_target(report_dir / name, True, option)
    probe_writable(report_dir, option)


def write_reports(result: dict[str, Any], report_dir: Path, *, force: bool = False
                  ) -> dict[str, str]:
    """Write report.json, report.md, report.html and junit.xml as one set; return their paths.

    All four are rendered, then written in full beside their final names, then put in place
    together (``io.atomic.write_files_atomic``): a full disk or an unwritable folder leaves the
    earlier report as it was, and without ``force`` a report file that appeared during the run
    (saved by the user, or another run's) is refused rather than replaced; either way nothing
    of this run's set is left.
    """
    from fp8export.io.atomic import write_files_atomic
    from fp8export.reports.html import html_report
    from fp8export.reports.junit import junit_xml

    report_dir = Path(report_dir)
    created = not report_dir.exists()
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Fp8ExportError(f"{report_dir}: cannot create the report folder "
                             f"({exc.strerror or exc}). Choose another --report-dir.") from exc
    paths = {name: report_dir / name for name in REPORT_FILES}
    result = dict(result)
    result["reports"] = {k: str(v) for k, v in paths.items()}
    contents = {
        paths["report.json"]: (json.dumps(report_dict(result), indent=2, allow_nan=False)
                               + "\n").encode(),
        paths["report.md"]: markdown(result).encode("utf-8"),
        paths["report.html"]: html_report(result).encode("utf-8"),
        paths["junit.xml"]: junit_xml(result),
    }
    try:
        write_files_atomic(contents, replace=force, what="the verify report")
    except Fp8ExportError:
        if created:
            with contextlib.suppress(OSError):
                report_dir.rmdir()
        raise
    return {k: str(v) for k, v in paths.items()}


@contextlib.contextmanager
def claimed_report_dir(report_dir: Path, force: bool, inputs=()):
    """The report folder, checked (:func:`check_report_dir`), created if missing and locked
    for the run: a second verify run into the same folder is refused at its start instead of
    replacing this run's report at its end. A folder created here and left empty (the run
    failed before any report) is removed again."""
    from fp8export.distributed import is_quiet_rank
    from fp8export.io.atomic import folder_lock

    report_dir = Path(report_dir)
    check_report_dir(report_dir, force, inputs)
    if is_quiet_rank():  # torchrun: rank 0 holds the folder and writes the reports
        yield report_dir
        return
    created = not report_dir.exists()
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Fp8ExportError(f"{report_dir}: cannot create the report folder "
                             f"({exc.strerror or exc}). Choose another --report-dir.") from exc
    try:
        with folder_lock(report_dir, "a verify report"):
            yield report_dir
    finally:
        if created:
            with contextlib.suppress(OSError):
                report_dir.rmdir()  # only when empty: a written report stays


def verify_and_report(cfg: VerifyConfig) -> VerifyResult:
    """``verify`` with its reports: the report folder is checked and locked before any model
    loads, and the reports are written as one set whether the candidate passes or fails
    (VerificationFailed is raised again after them, its result naming the files). Without
    ``--force`` a report file that appeared during the run is refused, not replaced."""
    from fp8export._progress import stage
    from fp8export.errors import VerificationFailed
    from fp8export.verify.run import verify
    from fp8export.verify.thresholds import PRESETS

    if not cfg.write_reports:
        return verify(cfg)
    if cfg.data is not None:  # a typo'd data file is named before the report folder
        from fp8export.inputs.samples import check_data_file

        check_data_file(cfg.data)
    thresholds_file = None if isinstance(cfg.thresholds, dict) or \
        str(cfg.thresholds) in PRESETS else Path(cfg.thresholds)
    from fp8export.distributed import rank0_writes

    # data parallel (torchrun): every rank judged the same merged comparison; rank 0 writes
    with claimed_report_dir(cfg.report_dir, cfg.force,
                            inputs=(cfg.reference, cfg.candidate, cfg.data, thresholds_file)):
        try:
            result = verify(cfg)
        except VerificationFailed as exc:
            result = exc.result
            with rank0_writes(f"writing the reports to {cfg.report_dir}") as writes:
                if writes:
                    with stage(f"writing the reports to {cfg.report_dir}"):
                        result.reports = write_reports(result.to_dict(), cfg.report_dir,
                                                       force=cfg.force)
            raise
        with rank0_writes(f"writing the reports to {cfg.report_dir}") as writes:
            if writes:
                with stage(f"writing the reports to {cfg.report_dir}"):
                    result.reports = write_reports(result.to_dict(), cfg.report_dir,
                                                   force=cfg.force)
    return result
