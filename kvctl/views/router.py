"""The router's figures: `kvctl bench router` (added latency) and `kvctl bench faults` (a kill under load).

Human form: plain aligned columns on stdout (people paste them into notes);
--json: the report, one object.
"""

from __future__ import annotations

from kvctl.views.output import Output

FAULT_FIGURES = ("victim", "requests", "concurrency", "outstanding_at_kill", "succeeded", "failed",
                 "failed_in_flight", "failed_later", "errors_name_victim", "recovery_s",
                 "chosen_after_down", "wrong_answers")
_PATHS = (("direct", "direct_ms"), ("router", "router_ms"), ("added", "added_ms"))


def render_faults(out: Output, report: dict) -> None:
    if out.json_mode:
        out.emit_json(report)
        return
    for key in FAULT_FIGURES:
        out.stdout.print(f"{key:<22} {report[key]}", markup=False, highlight=False)


def render_router_bench(out: Output, report: dict) -> None:
    if out.json_mode:
        out.emit_json(report)
        return
    lines = [f"router added latency, {report['requests']} requests per path (fake P/D answering at once)",
             f"{'mode':<14}{'path':<10}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}"]
    for mode, rows in report["modes"].items():
        for name, key in _PATHS:
            s = rows[key]
            lines.append(f"{mode:<14}{name:<10}{s['p50']:>9.3f}{s['p99']:>9.3f}{s['mean']:>9.3f}")
    for line in lines:
        out.stdout.print(line, markup=False, highlight=False)
