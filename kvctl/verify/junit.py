"""JUnit XML for CI dashboards, the one writer (verify's and scenario's files): one
testcase per check per verified request.

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


def new_tree(suite_name: str, seconds: float | None = None) -> tuple[ET.ElementTree, ET.Element]:
    """A <testsuites> tree holding one <testsuite>; `finish` counts its cases."""
    timed = {"time": f"{seconds:.3f}"} if seconds is not None else {}
    root = ET.Element("testsuites", tests="0", failures="0", errors="0", **timed)
    suite = ET.SubElement(root, "testsuite", name=suite_name, tests="0", failures="0", errors="0",
                          skipped="0", **timed)
    return ET.ElementTree(root), suite


def add_case(suite: ET.Element, classname: str, name: str, *, time: str = "0", out: str | None = None,
             failure: tuple[str, str, str] | None = None, skipped: str | None = None) -> ET.Element:
    """One <testcase>: passed (`out` its system-out), failed (`failure`: type, message, body)
    or skipped (`skipped`: the reason). Every text goes through `xml_text`."""
    case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=time)
    if failure is not None:
        kind, message, body = failure
        ET.SubElement(case, "failure", type=kind, message=one_line_message(message)).text = xml_text(body)
    elif skipped is not None:
        ET.SubElement(case, "skipped", message=one_line_message(skipped))
    elif out is not None:
        ET.SubElement(case, "system-out").text = xml_text(out)
    return case


def finish(tree: ET.ElementTree) -> ET.ElementTree:
    """Count each suite's cases into it and the root (tests, failures, skipped); indent."""
    root = tree.getroot()
    cases = [c for suite in root.findall("testsuite") for c in suite.findall("testcase")]
    for suite in root.findall("testsuite"):
        _count(suite, suite.findall("testcase"), skipped=True)
    _count(root, cases, skipped=False)
    ET.indent(root)
    return tree


def _count(element: ET.Element, cases: list[ET.Element], skipped: bool) -> None:
    element.set("tests", str(len(cases)))
    element.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
    if skipped:
        element.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))


def verify_junit(report: VerifyReport, suite_name: str | None = None) -> ET.ElementTree:
    """The report as a <testsuites> tree with one <testsuite> per cluster."""
    skipping = report.require == REQUIRE_OBSERVABLE
    run_failures = {f.instance: f for f in report.run_failures()}
    members = [(role, name) for role, names in judged_pools(report.pools).items() for name in names]
    served = report.served()
    unjudged = {name for _, name in members  # served none, but the pool was not judged (see the notes)
                if name not in run_failures and not served.get(name, {}).get("served")}
    seconds = sum((r.prefill_latency_s or 0) + (r.decode_latency_s or 0) + (r.baseline_latency_s or 0)
                  for r in report.requests)
    tree, suite = new_tree(suite_name or f"kvctl verify {report.cluster}", seconds)
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="baseline", value=report.baseline)
    ET.SubElement(props, "property", name="max_tokens", value=str(report.max_tokens))
    for i, request in enumerate(report.requests):
        for check in request.checks:
            classname = f"kvctl.verify.{report.cluster}.request{i}"
            if check.passed:
                add_case(suite, classname, check.name, out=check.evidence)
            elif not check.observable and skipping:
                add_case(suite, classname, check.name, skipped=check.evidence)
            else:
                add_case(suite, classname, check.name, failure=(
                    "CheckFailed" if check.observable else "NotObservable", check.evidence,
                    f"request {i}: {request.prompt_tokens} prompt tokens, key {request.key or '-'}\n"
                    f"{check.evidence}"))
    for role, name in members:
        classname = f"kvctl.verify.{report.cluster}.{name}"
        if name in run_failures:
            reason = run_failures[name].reason
            add_case(suite, classname, INSTANCE_SERVED, failure=("NeverServed", reason, reason))
        elif name in unjudged:
            why = " ".join(n for n in report.instance_notes() if name in n) or "not judged"
            add_case(suite, classname, INSTANCE_SERVED, skipped=why)
        else:
            add_case(suite, classname, INSTANCE_SERVED,
                     out=f"{role} instance {name} served {served.get(name, {}).get('served', 0)} of "
                         f"{len(report.requests)} requests")
    return finish(tree)


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


def xml_text(text: str) -> str:
    """`text` as XML 1.0 can hold it: each forbidden character (random-model outputs and
    server log tails hold control characters) becomes a visible \\xNN."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def one_line_message(text: str) -> str:
    """A failure's or skip's message attribute: one line, at most FAILURE_MESSAGE_CHARS."""
    return xml_text(" ".join(text.split())[:FAILURE_MESSAGE_CHARS])
