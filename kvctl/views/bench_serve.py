"""`kvctl bench serve`'s result: the two targets side by side, the ratios, the store fraction."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from kvctl.bench.report import fmt, machine_line
from kvctl.views.output import Output

_ROWS = (  # (label, figure path in a target, ratio key)
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), "ttft_p50"),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), "ttft_p99"),
    ("ITL p50 (ms)", ("itl_ms", "p50"), "itl_p50"),
    ("ITL p99 (ms)", ("itl_ms", "p99"), "itl_p99"),
    ("TPOT p50 (ms)", ("tpot_ms", "p50"), None),
    ("E2E p50 (ms)", ("e2el_ms", "p50"), None),
    ("requests/s", ("requests_per_s",), "requests_per_s"),
    ("output tokens/s", ("output_tokens_per_s",), None),
    ("completed", ("completed",), None),
    ("failed", ("failed",), None),
)


def _get(target: dict, path: tuple[str, ...]):
    value = target
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def serve_table(result: dict) -> Table:
    p = result["params"]
    load = (f"concurrency {p['concurrency']}" if p.get("concurrency") else "") + \
           (f", {p['request_rate']:g} req/s" if p.get("request_rate") else "")
    t = Table(title=f"kvctl bench serve {escape(result['cluster'])}: {p['requests']} requests, "
                    f"{p['input_len']} in / {p['output_len']} out tokens, {load.lstrip(', ')}",
              box=box.SIMPLE_HEAVY)
    compared = result.get("compared") or []
    # Each P/D target: (column title, its figures, its ratios to plain, what D served from the transfer).
    targets = [(_title(result["cluster"], result.get("transfer"), bool(compared)), result["pd"], result["ratios"],
                result["store"])]
    targets += [(_title(c["cluster"], c["transfer"], True), c["figures"], c["ratios"], c["store"]) for c in compared]
    t.add_column("figure")
    for title, *_ in targets:
        t.add_column(title, justify="right")
    t.add_column("plain vLLM", justify="right")
    for title, *_ in targets:
        t.add_column(f"{title.split(' ')[0]} / plain" if compared else "P/D / plain", justify="right")
    for label, path, ratio in _ROWS:
        t.add_row(label, *(fmt(_get(fig, path)) for _, fig, _, _ in targets), fmt(_get(result["plain"], path)),
                  *((fmt(r.get(ratio)) if ratio else "") for _, _, r, _ in targets))
    served = [f"{fmt(st['fraction'])} ({st['served_from_store']}/{st['decode_requests']})"
              if st.get("fraction") is not None else "not observable" for *_, st in targets]
    t.add_row("served by the transfer" if compared else "served from the store", *served, "-",
              *("" for _ in targets))
    return t


def _title(cluster: str, transfer: str | None, several: bool) -> str:
    """A P/D target's column: `FS P/D (name)` when several are compared, else `P/D (endpoint)`."""
    if not several:
        return "P/D (endpoint)"
    return f"{(transfer or 'P/D').upper()} P/D ({escape(cluster)})"


def render_serve(out: Output, result: dict) -> None:
    """The result's JSON object, or its table, the store fraction's source and the machine."""
    if out.json_mode:
        out.emit_json(result)
        return
    out.stdout.print(serve_table(result))
    store = result["store"]
    if store.get("fraction") is None:
        out.stdout.print(f"store fraction: {escape(store.get('reason') or 'unknown')}", highlight=False)
    else:
        out.stdout.print(f"store fraction from {escape(store['source'])}", highlight=False)
    outputs = result["outputs"]
    out.stdout.print(f"same text on both targets: {outputs['equal']}/{outputs['compared']} requests; "
                     f"time ratios: lower is better, requests/s: higher is better", highlight=False)
    for c in result.get("compared") or []:
        out.stdout.print(f"{escape(c['cluster'])} ({c['transfer']}): same text as plain on "
                         f"{c['outputs']['equal']}/{c['outputs']['compared']} requests; served by the transfer "
                         f"from {escape(c['store'].get('source') or c['store'].get('reason') or '?')}",
                         highlight=False)
    tool = result["load_tool"]
    out.stdout.print(f"load tool: {tool['name']} {tool.get('version') or ''} ({tool['backend']}, "
                     f"{tool['dataset']} prompts); plain: {result['plain']['url']}"
                     f"{' (launched for this run)' if result['plain'].get('launched') else ''}",
                     highlight=False)
    out.stdout.print(machine_line(result["machine"]), highlight=False)
