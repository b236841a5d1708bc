"""junit.xml: one test case per metric × threshold, so CI test views show the gate."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any


def junit_xml(result: dict[str, Any]) -> bytes:
    checks = result["checks"]
    failures = sum(c["status"] == "failed" for c in checks)
    skipped = sum(c["status"] == "skipped" for c in checks)
    suites = ET.Element("testsuites", name="fp8export verify", tests=str(len(checks)),
                        failures=str(failures))
    suite = ET.SubElement(suites, "testsuite", name="fp8export.verify", tests=str(len(checks)),
                          failures=str(failures), errors="0", skipped=str(skipped),
                          time=f"{result.get('timing', {}).get('total_s', 0.0):.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in (("reference", result["reference"]["path"]),
                       ("candidate", result["candidate"]["path"]),
                       ("backend", result["backend"]), ("samples", result["samples"]),
                       ("thresholds", result["thresholds_source"]),
                       ("metric_family", result.get("family", "logits"))):
        ET.SubElement(props, "property", name=key, value=str(value))
    for row in (result.get("noise_floor") or {}).get("rows") or []:
        ET.SubElement(props, "property", name=f"noise_floor.{row['metric']}",
                      value=f"{row['floor']:.6g}")
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=f"fp8export.verify.{c['metric']}",
                             name=c["name"], time="0")
        if c["status"] == "failed":
            f = ET.SubElement(case, "failure", message=c["message"], type="ThresholdFailed")
            f.text = c["message"]
        elif c["status"] == "skipped":
            ET.SubElement(case, "skipped", message=c["message"])
        else:
            out = ET.SubElement(case, "system-out")
            out.text = c["message"]
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)
