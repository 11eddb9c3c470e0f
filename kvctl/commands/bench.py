"""`kvctl bench store|layout|ttft|all|serve`: side-by-side performance ratios; `kvctl bench faults|router`:
the router under a kill and its added latency."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from kvctl.bench import faults, report, serve, suite
from kvctl.bench.common import check_repeat, parse_sizes
from kvctl.errors import BadInput
from kvctl.router import bench as router_bench
from kvctl.options import json_option
from kvctl.views.bench import progress_printer, render_results
from kvctl.views.bench_serve import render_serve
from kvctl.views.output import Output
from kvctl.views.router import render_faults, render_router_bench

bench_app = typer.Typer(
    help="Benchmarks, reported as ratios of figures measured side by side in one run "
         "(throughput ratios: ours / baseline, > 1 = ours faster). Run them under `nice` "
         "on a shared machine.",
    no_args_is_help=True,
)

JSON_OPT = json_option("Print one JSON object on stdout (top-level \"ratios\").")
REPEAT_OPT = typer.Option(suite.REPEAT, "--repeat", help="Timed runs per figure; the best counts.")
QUICK_OPT = typer.Option(False, "--quick", help="Small sizes only (a minute or two).")
SIZES_OPT_HELP = "Comma-separated (or repeated) sizes"


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("store")
def store_cmd(
    sizes: Optional[list[str]] = typer.Option(None, "--sizes", help=f"{SIZES_OPT_HELP}, in MB "
                                              "(default 1,64,512; --quick 1,8)."),
    repeat: int = REPEAT_OPT,
    quick: bool = QUICK_OPT,
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write (default "
                                             "$KVCTL_HOME/bench); its filesystem is measured."),
    scale: bool = typer.Option(False, "--scale", help="Also time publish, lookup and eviction with "
                               "1k, 10k and 100k (tiny) entries in a bounded store."),
    scale_entries: Optional[list[str]] = typer.Option(None, "--scale-entries", help="Comma-separated "
                                                      "counts of entries for --scale (default 1000,10000,100000)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Our FS store's save/load (also into a paged cache) vs raw file I/O and the peers' formats."""
    out = Output(json_mode=json_out)
    mb = parse_sizes(sizes, suite.STORE_QUICK_MB if quick else suite.STORE_SIZES_MB, "MB", integer=False)
    counts = None
    if scale or scale_entries:
        try:
            raw_counts = parse_sizes(scale_entries, suite.SCALE_ENTRIES, "entries", integer=True)
        except BadInput as e:
            raise BadInput(e.what, field="scale_entries", fix=e.fix) from None
        counts = suite.check_scale_entries(raw_counts)
    result = suite.run_store(mb, check_repeat(repeat), directory, progress_printer(out), scale_entries=counts,
                             scale_publishes=suite.SCALE_QUICK_PUBLISHES if quick else suite.SCALE_PUBLISHES)
    render_results(out, [result])


@bench_app.command("layout")
def layout_cmd(
    sizes: Optional[list[str]] = typer.Option(None, "--sizes", help=f"{SIZES_OPT_HELP}, in tokens "
                                              "(default 1024,2048,4096; --quick 256,1024)."),
    repeat: int = REPEAT_OPT,
    quick: bool = QUICK_OPT,
    device: str = typer.Option("auto", "--device", help="auto (CUDA when torch sees one), cpu or cuda."),
    threads: int = typer.Option(suite.LAYOUT_THREADS, "--threads", help="torch threads on CPU "
                                "(0: torch's default; 1 is stable on a shared machine)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Gather/scatter through the V0 paged KV layouts (CPU paged, flash, flashinfer, MLA) vs a plain memcpy."""
    out = Output(json_mode=json_out)
    tokens = parse_sizes(sizes, suite.LAYOUT_QUICK_TOKENS if quick else suite.LAYOUT_TOKENS,
                         "tokens", integer=True)
    result = suite.run_layout([int(t) for t in tokens], check_repeat(repeat), device, threads,
                              progress_printer(out))
    render_results(out, [result])


@bench_app.command("ttft")
def ttft_cmd(
    sizes: Optional[list[str]] = typer.Option(None, "--sizes", help=f"{SIZES_OPT_HELP}: prompt "
                                              "lengths in tokens (default 512,1024,2048; --quick 256,512)."),
    repeat: int = REPEAT_OPT,
    quick: bool = QUICK_OPT,
    model: Optional[Path] = typer.Option(None, "--model", help="HF model dir (default: the bench "
                                         "model, `kvctl model bench`)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Decode TTFT with KV from the store vs recomputing and vs a 1-token prompt; MultiConnectorV0's send costs.

    Launches one real 1P1D cluster of vLLM CPU servers and tears it down.
    """
    out = Output(json_mode=json_out)
    tokens = parse_sizes(sizes, suite.TTFT_QUICK_TOKENS if quick else suite.TTFT_TOKENS,
                         "tokens", integer=True)
    result = suite.run_ttft([int(t) for t in tokens], check_repeat(repeat), model, progress_printer(out))
    render_results(out, [result])


@bench_app.command("all")
def all_cmd(
    repeat: int = REPEAT_OPT,
    quick: bool = QUICK_OPT,
    directory: Optional[Path] = typer.Option(None, "--dir", help="Store bench dir (default $KVCTL_HOME/bench)."),
    model: Optional[Path] = typer.Option(None, "--model", help="ttft model (default: the bench model)."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the README "
                                            "results table (markdown) to this file."),
    json_out: bool = JSON_OPT,
) -> None:
    """store, layout and ttft with their default sizes; optionally the README table."""
    out = Output(json_mode=json_out)
    if markdown is not None and markdown.is_dir():
        raise BadInput(f"{markdown} is a directory", where="--markdown", fix="pass a file path")
    results = suite.run_all(quick, check_repeat(repeat), directory, model, progress_printer(out))
    if markdown is not None:
        markdown.write_text(report.markdown(results, suite.README_COMMAND))
        out.info(f"wrote {escape(str(markdown))}")
    render_results(out, results)


@bench_app.command("serve")
def serve_cmd(
    cluster: Optional[str] = typer.Argument(None, metavar="[NAME]", help="Cluster name (default: 'default'; "
                                            "--name works too)."),
    name: Optional[str] = typer.Option(None, "--name", help="Cluster name (the same as NAME)."),
    requests: int = typer.Option(serve.REQUESTS, "--requests", help="Requests sent to each target."),
    concurrency: Optional[int] = typer.Option(serve.CONCURRENCY, "--concurrency",
                                              help="Requests in flight at once (0: no cap; then give "
                                                   "--request-rate)."),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Requests per second "
                                                 "(Poisson arrivals; default: as fast as the concurrency allows)."),
    input_len: int = typer.Option(serve.INPUT_LEN, "--input-len", help="Prompt tokens (random prompts, the same "
                                  "for both targets)."),
    output_len: int = typer.Option(serve.OUTPUT_LEN, "--output-len", help="Tokens generated per request."),
    plain_url: Optional[str] = typer.Option(None, "--plain-url", help="An existing plain vLLM server (same model, "
                                            "no KV transfer) instead of launching one: needed for attached and "
                                            "docker clusters."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="The model dir the load tool tokenizes "
                                             "with (default: the cluster's model; attached clusters may need it)."),
    seed: int = typer.Option(serve.SEED, "--seed", help="Seed of the random prompts."),
    timeout: float = typer.Option(serve.TIMEOUT_S, "--timeout", help="Seconds one target's load run may take."),
    compare: list[str] = typer.Option([], "--compare", metavar="CLUSTER",
                                      help="Another P/D cluster (same model) driven in the same run, beside the "
                                           "first and the plain server, e.g. an FS cluster --compare a NIXL one "
                                           "(repeatable; JSON: \"compared\")."),
    json_out: bool = json_option("Print one JSON object on stdout (top-level \"ratios\": pd / plain, and the "
                                 "\"pd\" and \"plain\" figures)."),
) -> None:
    """A real load tool against the P/D endpoint and a plain vLLM server.

    Both targets get the same seeded random prompts: (a) the cluster's
    endpoint (its router: P, the store, then D) and (b) one plain vLLM
    server with the same model and no KV transfer, launched from the
    cluster's rig and engine and always stopped afterwards (or --plain-url,
    which attached and docker clusters need). Reported side by side: TTFT
    and inter-token latency p50/p99, requests/s, and the fraction of P/D
    requests D served from the store (from D's logs; null with the reason
    when an attached cluster's logs are out of reach). Ratios are
    pd / plain: below 1 is faster for times, above 1 for requests/s.
    The load tool is vLLM's own `vllm bench serve`, run from the rig: it is
    installed wherever a cluster can run (no new dependency, unlike guidellm
    or aiperf), speaks the vLLM API the router serves, and saves every
    figure as JSON. A cluster's API key (launched with --api-key; attached:
    $KVCTL_API_KEY) reaches the tool as its OPENAI_API_KEY, never in argv.
    """
    out = Output(json_mode=json_out)
    if cluster is not None and name is not None and cluster != name:
        raise BadInput(f"two cluster names given: {cluster!r} and --name {name!r}", where="NAME / --name",
                       fix="name the cluster once")
    opts = serve.ServeOptions(requests=requests, concurrency=concurrency or None, request_rate=request_rate,
                              input_len=input_len, output_len=output_len, plain_url=plain_url,
                              tokenizer=tokenizer, seed=seed, timeout_s=timeout, compare=tuple(compare))
    if concurrency is not None and concurrency < 0:
        raise BadInput(f"concurrency must be 0 or more, got {concurrency}", where="--concurrency",
                       fix=f"pass e.g. {serve.CONCURRENCY} (0: no cap, with --request-rate)")
    result = serve.run_serve_bench(cluster or name or "default", opts, progress_printer(out))
    render_serve(out, result)


@bench_app.command("faults")
def faults_cmd(
    name: str = typer.Argument(..., metavar="NAME", help="A cluster kvctl launched, with a pool of two or more "
                                                         "of the victim's role (`kvctl launch pd`)."),
    kill: str = typer.Option(..., "--kill", metavar="INSTANCE", help="The instance to kill -9, e.g. decode-1."),
    requests: int = typer.Option(faults.REQUESTS, "--requests", help="Chat completions sent through the router."),
    concurrency: int = typer.Option(faults.CONCURRENCY, "--concurrency", help="Clients sending at once."),
    max_tokens: int = typer.Option(faults.MAX_TOKENS, "--max-tokens", help="Tokens per answer."),
    json_out: bool = json_option("Print one JSON object (the figures) on stdout."),
) -> None:
    """Kill one instance of a running xPyD cluster under load through its router; how the router copes.

    Its runtime kills the victim (SIGKILL) once a quarter of the requests are done
    and it has requests in flight. Reported: the failures (in flight on the
    victim, or later: must be 0), whether each error names the victim, the
    recovery time until the router marked it down, requests it sent there
    afterwards (must be 0) and wrong answers (must be 0). It kills a server:
    never run it on a cluster that serves anyone else.
    """
    out = Output(json_mode=json_out)
    render_faults(out, faults.measure_fault(name, kill, requests, concurrency, max_tokens))


@bench_app.command("router")
def router_cmd(
    requests: int = typer.Option(router_bench.REQUESTS, "--requests", help="Measured requests per path and mode."),
    warmup: int = typer.Option(router_bench.WARMUP, "--warmup", help="Unmeasured requests first."),
    json_out: bool = json_option("Print one JSON object (per mode: direct_ms, router_ms, added_ms) on stdout."),
) -> None:
    """The router's added latency per request, against instant fake P and D servers (p50/p99/mean)."""
    out = Output(json_mode=json_out)
    render_router_bench(out, router_bench.measure(requests, warmup))
