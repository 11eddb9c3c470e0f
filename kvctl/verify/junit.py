"""JUnit XML for CI dashboards: one testcase per check per verified request.

Test case class names (`kvctl.verify.<cluster>.request<i>`) are what CI
dashboards group by: they name the cluster and request, not a Python module.
A check that was not observable is a failure (type NotObservable) under
`require: all`, and skipped (with the reason) under `require: observable`.
Each member of a pool of two or more instances gets one more testcase,
`instance_served` (class `kvctl.verify.<cluster>.<instance>`): failed when it
served none of the requests (the run's failure), passed with its count.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from kvctl.errors import BadInput
from kvctl.verify.report import INSTANCE_SERVED, REQUIRE_OBSERVABLE, VerifyReport, judged_pools

FAILURE_MESSAGE_CHARS = 300  # the attribute is a one-line summary; the body has everything
# Characters XML 1.0 forbids even escaped; random-model outputs can contain them.
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def verify_junit(report: VerifyReport, suite_name: str | None = None) -> ET.ElementTree:
    """The report as a <testsuites> tree with one <testsuite> per cluster."""
    cases = [(i, r, c) for i, r in enumerate(report.requests) for c in r.checks]
    skipping = report.require == REQUIRE_OBSERVABLE
    skipped = sum(1 for _, _, c in cases if not c.observable and skipping)
    run_failures = {f.instance: f for f in report.run_failures()}
    members = [(role, name) for role, names in judged_pools(report.pools).items() for name in names]
    served = report.served()
    unjudged = {name for _, name in members  # served none, but the pool was not judged (see the notes)
                if name not in run_failures and not served.get(name, {}).get("served")}
    failures = sum(1 for _, _, c in cases if not c.passed) - skipped + len(run_failures)
    skipped += len(unjudged)
    total = len(cases) + len(members)
    seconds = sum((r.prefill_latency_s or 0) + (r.decode_latency_s or 0) + (r.baseline_latency_s or 0)
                  for r in report.requests)
    root = ET.Element("testsuites", tests=str(total), failures=str(failures), errors="0",
                      time=f"{seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=suite_name or f"kvctl verify {report.cluster}",
                          tests=str(total), failures=str(failures), errors="0", skipped=str(skipped),
                          time=f"{seconds:.3f}")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="baseline", value=report.baseline)
    ET.SubElement(props, "property", name="max_tokens", value=str(report.max_tokens))
    for i, request, check in cases:
        case = ET.SubElement(suite, "testcase", classname=f"kvctl.verify.{report.cluster}.request{i}",
                             name=check.name, time="0")
        if check.passed:
            ET.SubElement(case, "system-out").text = _xml_safe(check.evidence)
        elif not check.observable and skipping:
            ET.SubElement(case, "skipped", message=_xml_safe(_one_line(check.evidence)[:FAILURE_MESSAGE_CHARS]))
        else:
            failure = ET.SubElement(case, "failure", type="CheckFailed" if check.observable else "NotObservable",
                                    message=_xml_safe(_one_line(check.evidence)[:FAILURE_MESSAGE_CHARS]))
            failure.text = _xml_safe(f"request {i}: {request.prompt_tokens} prompt tokens, "
                                     f"key {request.key or '-'}\n{check.evidence}")
    for role, name in members:
        case = ET.SubElement(suite, "testcase", classname=f"kvctl.verify.{report.cluster}.{name}",
                             name=INSTANCE_SERVED, time="0")
        if name in run_failures:
            reason = run_failures[name].reason
            failure = ET.SubElement(case, "failure", type="NeverServed",
                                    message=_xml_safe(_one_line(reason)[:FAILURE_MESSAGE_CHARS]))
            failure.text = _xml_safe(reason)
        elif name in unjudged:
            why = " ".join(n for n in report.instance_notes() if name in n) or "not judged"
            ET.SubElement(case, "skipped", message=_xml_safe(_one_line(why)[:FAILURE_MESSAGE_CHARS]))
        else:
            ET.SubElement(case, "system-out").text = _xml_safe(
                f"{role} instance {name} served {served.get(name, {}).get('served', 0)} of "
                f"{len(report.requests)} requests")
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(tree: ET.ElementTree, path: Path | str) -> Path:
    """Write a JUnit tree. Raises BadInput when the path cannot be written."""
    path = Path(path)
    try:
        tree.write(path, encoding="utf-8", xml_declaration=True)
    except OSError as e:
        raise BadInput(f"cannot write the JUnit file: {e}", where=str(path),
                       fix="use a path in a writable, existing directory") from None
    return path


def write_verify_junit(report: VerifyReport, path: Path | str) -> Path:
    """Write verify's JUnit file. Raises BadInput when the path cannot be written."""
    return write_junit(verify_junit(report), path)


def _xml_safe(text: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _one_line(text: str) -> str:
    return " ".join(text.split())
