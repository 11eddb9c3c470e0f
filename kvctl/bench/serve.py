"""`kvctl bench serve`: a real load tool against the P/D endpoint and one plain vLLM server.

One run drives the same load, with the same prompts, at two targets:

    pd     the cluster's endpoint (kvctl's router, or the one an attached cluster
           names): P prefills, publishes the KV to the store, D loads it and decodes
    plain  one vLLM server with the same model and no KV transfer at all: launched
           here from the cluster's rig and engine (one core, the same vLLM
           arguments as the cluster's servers, no connector) and always stopped
           afterwards, also on Ctrl-C, SIGTERM or a failure; or an existing one
           (`plain_url`, needed for attached and docker clusters)

and reports each target's TTFT and inter-token latency (p50/p99, ms), requests/s
and output tokens/s, the ratios pd / plain (`ratios`: ttft_p50, ttft_p99,
itl_p50, itl_p99 are time ratios, lower is better; requests_per_s is a
throughput ratio, higher is better), and the fraction of the P/D requests D
served from the store.

The load tool is vLLM's own `vllm bench serve`, run as a subprocess of the V0
rig's interpreter (`python -m vllm.entrypoints.cli.main bench serve`). Why it and
not guidellm or aiperf: it is already installed wherever kvctl can launch a
cluster (no new dependency, no second tokenizer stack), it speaks exactly the
vLLM OpenAI API the servers and the router serve (streamed /v1/completions), its
random dataset is reproducible from a seed (both targets get byte-identical
prompts), and its `--save-result --save-detailed` JSON has every figure we
report (TTFT, ITL, TPOT, E2E percentiles, request throughput, per-request
errors and texts), so kvctl parses no console output. kvctl never imports
vLLM: the tool is a separate process. A cluster launched with an API key (or
an attached one, with $KVCTL_API_KEY) gets it through the tool's OPENAI_API_KEY,
which `vllm bench serve` sends as `Authorization: Bearer KEY` (the plain server
kvctl starts requires none and ignores it).

The store fraction comes from the decode instances' logs, read from where each
ended when the P/D run started: V0 D's `skip model forwarding ... keys=` lines
(one key per prompt served from the store) over the requests D logged
(`Received request`); V1 D's `KV load DONE|NONE|FAILED` lines (one per request,
DONE with tokens loaded counts). When D logs no request lines at all, the
requests the tool sent through the endpoint (its warm-up request included)
are the denominator. An attached cluster whose decode logs are out of reach
reports the fraction as null with the reason (never a guess); log commands
(`cmd:...`) are captured while the P/D run lasts, as verify does.

Library code: nothing here prints; progress lines go to a callback.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from connectors.config.topology import handshake_connector, transfer_connector, transfer_store
from kvctl.bench.common import Progress, machine_info, quiet
from kvctl.cluster.lifecycle import LaunchProgress, wait_instances_healthy
from kvctl.signals import signals_interrupt
from kvctl.cluster.spec import model_dtype, spread_cpu_binds
from kvctl.cluster.state import ClusterState, cluster_api_key, cluster_dir, load_cluster
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.net import NotHealthy, answers_health, free_ports, unhealthy_reason, wait_healthy
from kvctl.provision.rig import rig_python
from kvctl.runtime import get_runtime
from kvctl.runtime.base import BLOCK_SIZE, DEFAULT_ENGINE, Instance, InstanceSpec
from kvctl.subprocesses import run_streamed
from kvctl.verify import markers
from kvctl.verify import nixl as nixl_evidence
from kvctl.verify.cluster_info import cluster_info
from kvctl.verify.log_files import LOG_WAIT_S, LogPool, capturing_logs

# ---- defaults, in one place ----
LOAD_TOOL = "vllm bench serve"
LOAD_TOOL_MODULE = "vllm.entrypoints.cli.main"  # what the rig's `vllm` script runs
REQUESTS = 32  # prompts per target
CONCURRENCY = 4  # requests in flight at once (the tool's --max-concurrency)
INPUT_LEN = 128  # tokens per random prompt
OUTPUT_LEN = 16  # tokens generated per request (ignore_eos: exactly this many)
SEED = 0  # the random dataset's seed: both targets get the same prompts
TIMEOUT_S = 1800.0  # one target's whole load run
PLAIN_READY_S = 600.0  # the plain server's start-up (a cold CPU start takes a minute or two)
PLAIN_NOTE_S = 15.0  # a progress line this often while the plain server starts
ENDPOINT_READY_S = 180.0  # a P/D endpoint's /health back to 200 before its run (a starved host's router
                          # marks instances unhealthy while the plain server starts)
PLAIN_ROLE = "plain vLLM"  # as its start-up errors name it: "the plain vLLM server exited ..."
HEALTH_TIMEOUT_S = 5.0
PERCENTILES = "50,99"
TOOL_API_KEY_ENV = "OPENAI_API_KEY"  # vllm bench serve sends `Authorization: Bearer $OPENAI_API_KEY`
PLAIN_NAME = "bench-plain"  # the plain server's name: its log is logs/bench-plain.log
TARGETS = ("pd", "plain")
RATIO_KEYS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "requests_per_s")
RATIO_DEFINITIONS = {
    "ttft_p50": "P/D median time to first token / the plain server's (lower is better)",
    "ttft_p99": "P/D p99 time to first token / the plain server's (lower is better)",
    "itl_p50": "P/D median inter-token latency / the plain server's (lower is better)",
    "itl_p99": "P/D p99 inter-token latency / the plain server's (lower is better)",
    "requests_per_s": "P/D completed requests per second / the plain server's (higher is better)",
}
_TQDM_RE = re.compile(r"\|\s*(\d+)/(\d+)\s*\[")
_URL_RE = re.compile(r"^https?://[^/\s]+$")
_LABELS = {"requests": "the number of requests", "input_len": "the input length (tokens)",
           "output_len": "the output length (tokens)", "concurrency": "the concurrency"}
# ---------------------------------


@dataclass(frozen=True)
class ServeOptions:
    """What one `bench serve` run sends (validate with `check_options`)."""

    requests: int = REQUESTS
    concurrency: int | None = CONCURRENCY  # None: no cap (with a request rate)
    request_rate: float | None = None  # requests/s (Poisson arrivals); None: all at once, capped
    input_len: int = INPUT_LEN
    output_len: int = OUTPUT_LEN
    plain_url: str | None = None  # an existing plain server instead of launching one
    tokenizer: Path | None = None  # HF model dir for the tool's tokenizer (default: the cluster's model)
    seed: int = SEED
    timeout_s: float = TIMEOUT_S
    # More P/D clusters driven in the same run, each its own target beside the first (e.g.
    # FS P/D, NIXL P/D and the plain server side by side). Same model, same prompts.
    compare: tuple[str, ...] = ()


def check_options(opts: ServeOptions) -> ServeOptions:
    """`opts`, checked, with the URL normalised. Raises BadInput naming the field:
    `requests`, `concurrency`, `request_rate`, `input_len`, `output_len`,
    `plain_url`, `tokenizer`, `timeout`."""
    def positive_int(value: Any, name: str, example: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(f"{_LABELS[name]} must be a whole number of at least 1, got {value!r}",
                           field=name, fix=f"pass e.g. {example}")

    positive_int(opts.requests, "requests", REQUESTS)
    positive_int(opts.input_len, "input_len", INPUT_LEN)
    positive_int(opts.output_len, "output_len", OUTPUT_LEN)
    if opts.concurrency is not None:
        positive_int(opts.concurrency, "concurrency", CONCURRENCY)
    if opts.request_rate is not None and not (math.isfinite(opts.request_rate) and opts.request_rate > 0):
        raise BadInput(f"request rate must be a positive number of requests per second, got {opts.request_rate}",
                       field="request_rate", fix="pass e.g. 2.5, or leave it out (all at once, capped by "
                                                 "the concurrency)")
    if opts.concurrency is None and opts.request_rate is None:
        raise BadInput("neither a concurrency nor a request rate: every request would start at once",
                       field=("concurrency", "request_rate"), fix=f"give a concurrency (e.g. {CONCURRENCY}) "
                                                                  "or a request rate")
    if not opts.timeout_s > 0:
        raise BadInput(f"timeout must be positive, got {opts.timeout_s}", field="timeout",
                       fix=f"pass seconds, e.g. {TIMEOUT_S:g}")
    plain = opts.plain_url
    if plain is not None:
        plain = plain.strip().rstrip("/")
        if not _URL_RE.match(plain):
            raise BadInput(f"{opts.plain_url!r} is not a server's base URL", field="plain_url",
                           fix="give the plain vLLM server as http://HOST:PORT, e.g. http://127.0.0.1:8300")
    tokenizer = opts.tokenizer
    if tokenizer is not None:
        tokenizer = tokenizer.expanduser().absolute()
        if not (tokenizer / "config.json").is_file():
            raise BadInput(f"{tokenizer} is not a Hugging Face model directory (no config.json)",
                           field="tokenizer", fix="give the served model's directory (its tokenizer "
                                                  "files and config.json)")
    return ServeOptions(opts.requests, opts.concurrency, opts.request_rate, opts.input_len,
                        opts.output_len, plain, tokenizer, opts.seed, opts.timeout_s, tuple(opts.compare))


# --- what a target's run gives ---

def _f(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def target_figures(raw: dict, url: str) -> dict:
    """One target's figures from the tool's saved result (`--save-result --save-detailed`)."""
    errors = [e for e in raw.get("errors") or [] if e]
    completed = int(raw.get("completed") or 0)
    return {
        "url": url,
        "completed": completed,
        "failed": int(raw.get("num_prompts") or completed) - completed,
        "duration_s": _f(raw.get("duration")),
        "requests_per_s": _f(raw.get("request_throughput")),
        "output_tokens_per_s": _f(raw.get("output_throughput")),
        "total_output_tokens": raw.get("total_output_tokens"),
        **{f"{m}_ms": {"p50": _f(raw.get(f"p50_{m}_ms")), "p99": _f(raw.get(f"p99_{m}_ms")),
                       "mean": _f(raw.get(f"mean_{m}_ms"))} for m in ("ttft", "itl", "tpot", "e2el")},
        "first_error": errors[0][-500:] if errors else None,
    }


def ratios_of(pd: dict, plain: dict) -> dict[str, float | None]:
    """pd / plain for each RATIO_KEYS figure (None when either side has none)."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    return {"ttft_p50": ratio(pd["ttft_ms"]["p50"], plain["ttft_ms"]["p50"]),
            "ttft_p99": ratio(pd["ttft_ms"]["p99"], plain["ttft_ms"]["p99"]),
            "itl_p50": ratio(pd["itl_ms"]["p50"], plain["itl_ms"]["p50"]),
            "itl_p99": ratio(pd["itl_ms"]["p99"], plain["itl_ms"]["p99"]),
            "requests_per_s": ratio(pd["requests_per_s"], plain["requests_per_s"])}


def same_outputs(pd_raw: dict, plain_raw: dict) -> dict:
    """How many requests generated the same text on both targets (greedy: they should)."""
    a, b = pd_raw.get("generated_texts") or [], plain_raw.get("generated_texts") or []
    pairs = [(x, y) for x, y, ea, eb in zip(a, b, pd_raw.get("errors") or [""] * len(a),
                                            plain_raw.get("errors") or [""] * len(b)) if not ea and not eb]
    return {"compared": len(pairs), "equal": sum(1 for x, y in pairs if x == y)}


def store_fraction(decode_log: str, sent: int) -> dict:
    """The P/D requests D served from the store, from the decode logs of the run. Pure.

    V1 D: one `KV load ...` line per request (DONE with tokens loaded counts).
    V0 D: the keys on `skip model forwarding` lines over the `Received request`
    lines; `sent` (requests the tool sent through the endpoint) when D logged none.
    """
    pulled = nixl_evidence.parse(decode_log).received
    if pulled:  # NIXL: one `Finished recving` per request D pulled from P
        served = len({line.request for line in pulled})
        return {"fraction": round(min(1.0, served / sent), 4) if sent else None, "served_from_store": served,
                "decode_requests": sent, "source": "decode logs: NIXL `Finished recving` lines / requests sent"}
    loads = markers.kv_loads(decode_log)
    if loads:
        served = sum(1 for line in loads if line.outcome == "DONE" and line.loaded)
        return {"fraction": round(served / len(loads), 4), "served_from_store": served,
                "decode_requests": len(loads), "source": "decode logs: V1 `KV load` lines"}
    served = sum(len(s.keys) or 1 for s in markers.skip_forwards(decode_log))
    received = len(markers.received_requests(decode_log))
    total, source = ((received, "decode logs: `skip model forwarding` keys / `Received request` lines")
                     if received else
                     (sent, "decode logs: `skip model forwarding` keys / requests sent through the endpoint"))
    if total <= 0:
        return {"fraction": None, "served_from_store": served, "decode_requests": 0, "source": source,
                "reason": "no request reached a decode instance"}
    return {"fraction": round(min(1.0, served / total), 4), "served_from_store": served,
            "decode_requests": total, "source": source}


# --- the load tool ---

def tool_argv(python: Path, url: str, served_name: str, tokenizer: Path, opts: ServeOptions,
              result_dir: Path, label: str) -> list[str]:
    """The `vllm bench serve` command line for one target."""
    argv = [str(python), "-m", LOAD_TOOL_MODULE, "bench", "serve",
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", str(tokenizer), "--served-model-name", served_name, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(opts.input_len),
            "--random-output-len", str(opts.output_len), "--num-prompts", str(opts.requests),
            "--seed", str(opts.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", f"{label}.json", "--label", label]
    if opts.concurrency is not None:
        argv += ["--max-concurrency", str(opts.concurrency)]
    if opts.request_rate is not None:
        argv += ["--request-rate", repr(opts.request_rate)]
    return argv


def _tool_progress(label: str, progress: Progress):
    """Turn the tool's output into progress lines: `pd: 12/32 requests done` and its milestones."""
    last = [-1]

    def on_line(line: str) -> None:
        m = _TQDM_RE.search(line)
        if m:
            done = int(m.group(1))
            if done != last[0]:
                last[0] = done
                progress(f"{label}: {done}/{m.group(2)} requests done")
            return
        text = line.strip()
        if text.startswith(("Starting initial", "Initial test run completed", "Traceback", "Error",
                            "ValueError", "RuntimeError")) or "Benchmark duration" in text:
            progress(f"{label}: {text}")

    return on_line


def tool_env(api_key: str | None) -> dict[str, str]:
    """The tool's environment: ours, offline, unbuffered, and the API key (or none) it sends."""
    env = {k: v for k, v in os.environ.items() if k != TOOL_API_KEY_ENV}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    if api_key:
        env[TOOL_API_KEY_ENV] = api_key
    return env


def run_tool(label: str, url: str, served_name: str, tokenizer: Path, opts: ServeOptions,
             work: Path, progress: Progress, api_key: str | None = None) -> dict:
    """One target's load run; the tool's saved result (detailed). `api_key`: sent as
    `Authorization: Bearer KEY` (through the tool's environment, not its command line).

    Raises RuntimeFailure when the tool fails, times out, or no request succeeded.
    """
    python = rig_python()
    argv = tool_argv(python, url, served_name, tokenizer, opts, work, label)
    env = tool_env(api_key)
    progress(f"{label}: {LOAD_TOOL} against {url} ({opts.requests} requests)")
    try:
        done = run_streamed(argv, _tool_progress(label, progress), env=env, cwd=str(work),
                            timeout_s=opts.timeout_s)
    except OSError as e:
        raise RuntimeFailure(f"could not run {LOAD_TOOL}: {e}", where=str(python),
                             fix="check the rig with `kvctl rig status`") from None
    where = f"{LOAD_TOOL} against {url}"
    if done.timed_out:
        raise RuntimeFailure(f"{LOAD_TOOL} ran longer than {opts.timeout_s:g} s against the {label} target "
                             "and was stopped", where=where, fix="send fewer requests or raise the timeout",
                             details=done.details)
    path = work / f"{label}.json"
    if done.returncode != 0 or not path.is_file():
        raise RuntimeFailure(f"{LOAD_TOOL} failed against the {label} target (exit {done.returncode})",
                             where=where, fix="read the tool's output below (is the server healthy and "
                                              "serving the model?)", details=done.details)
    raw = json.loads(path.read_text())
    if not raw.get("completed"):
        first = next((e for e in raw.get("errors") or [] if e), "")[-2000:] or done.details
        with httpx.Client() as client:
            reason = unhealthy_reason(client, url)  # a router's 503 names the instance it holds down
        raise RuntimeFailure(f"no request succeeded against the {label} target {url}", where=where,
                             fix="read the first error below and the server's log",
                             details="\n".join(filter(None, (first, reason))))
    return raw


# --- the plain server ---

def _healthy(url: str) -> bool:
    with httpx.Client() as client:
        return answers_health(client, url, HEALTH_TIMEOUT_S)


def _served_models(url: str) -> list[str] | None:
    try:
        resp = httpx.get(f"{url}/v1/models", timeout=HEALTH_TIMEOUT_S)
        return [m.get("id") for m in resp.json().get("data", [])] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def check_plain_url(url: str, served_name: str) -> None:
    """Raises BadInput (field `plain_url`) unless `url` is healthy and serves `served_name`."""
    if not _healthy(url):
        raise BadInput(f"the plain server {url} does not answer /health with 200", field="plain_url",
                       fix="start it (the same model, no kv-transfer-config) or give its right URL")
    models = _served_models(url)
    if models is not None and served_name not in models:
        raise BadInput(f"the plain server {url} serves {', '.join(map(str, models)) or 'no model'}, "
                       f"not the cluster's {served_name!r}", field="plain_url",
                       fix=f"start it with the same model, served as {served_name!r}")


def plain_spec(state: ClusterState) -> InstanceSpec:
    """The plain server for `state`: its model, served name and decode engine, no connector,
    one core, its log beside the cluster's (logs/bench-plain.log)."""
    decode = next(iter(state.by_role("decode").values()), None)
    engine = (decode.runtime_fields.get("vllm_engine") if decode else None) or DEFAULT_ENGINE
    model = Path(state.model)
    cdir = cluster_dir(state.name)
    return InstanceSpec(cluster=state.name, role=PLAIN_NAME, model=model,
                        served_model_name=state.served_model_name, dtype=model_dtype(model),
                        port=free_ports(1)[0], cwd=cdir, log_path=cdir / "logs" / f"{PLAIN_NAME}.log",
                        kv_transfer_config=None, worker_cls=None,
                        block_size=BLOCK_SIZE if engine == "v0" else None, engine=engine,
                        cpu_bind=spread_cpu_binds(1)[0])


@contextmanager
def plain_server(state: ClusterState, progress: Progress) -> Iterator[str]:
    """Start the plain server for `state`, yield its URL once healthy, always stop it.

    Raises BadInput for a cluster it cannot start one for (attached, docker,
    no model dir here), RuntimeFailure when it dies or is not healthy in time.
    """
    runtime = get_runtime(state.runtime)
    if not runtime.host_rigs:
        what = ("attached (kvctl did not start it)" if not runtime.starts_servers
                else f"on the {state.runtime} runtime")
        raise BadInput(f"cluster {state.name!r} is {what}: kvctl starts the plain server only beside a "
                       "local cluster", field="plain_url",
                       fix="start a vLLM server with the same model and no kv-transfer-config, and pass "
                           "its URL as the plain URL")
    spec = plain_spec(state)
    if not (spec.model / "config.json").is_file():
        raise BadInput(f"the cluster's model directory {spec.model} is not here", field="plain_url",
                       fix="pass the URL of a plain server with the same model")
    runtime.check_instance(spec)  # the rig of its engine
    progress(f"plain: starting a vLLM server (engine {spec.engine}, no KV transfer) on port {spec.port}")
    inst: Instance | None = None
    try:
        inst = runtime.start(spec)
        _wait_plain(inst, state.name, progress)
        yield inst.url
    finally:
        if inst is not None:
            _stop_all_the_way(inst)
            progress("plain: server stopped")


def _stop_all_the_way(inst: Instance) -> None:
    """Stop `inst`; a Ctrl-C while stopping restarts the stop (it is idempotent)."""
    while True:
        try:
            inst.stop()
            return
        except KeyboardInterrupt:
            continue


def _wait_plain(inst: Instance, cluster: str, progress: Progress) -> None:
    """Wait until the plain server is healthy: `plain: starting (N s)` every 15 s, then
    `plain: server healthy after N s`. Raises RuntimeFailure when it dies or times out."""
    next_note = [PLAIN_NOTE_S]

    def on_report(report: LaunchProgress) -> None:
        rp = report.roles[PLAIN_ROLE]
        if rp.state == "healthy":
            progress(f"plain: server healthy after {rp.ready_s:.0f} s")
        elif rp.state == "starting" and report.elapsed_s >= next_note[0]:
            progress(f"plain: starting ({report.elapsed_s:.0f} s)")
            next_note[0] = report.elapsed_s + PLAIN_NOTE_S

    wait_instances_healthy({PLAIN_ROLE: inst}, PLAIN_READY_S, time.monotonic(), on_report, cluster)


# --- the whole run ---

def _tokenizer_for(state: ClusterState, opts: ServeOptions) -> Path:
    if opts.tokenizer is not None:
        return opts.tokenizer
    model = Path(state.model)
    if model.is_absolute() and (model / "config.json").is_file():
        return model
    raise BadInput(f"cluster {state.name!r}'s model {state.model!r} is not a model directory here, and the "
                   f"load tool needs its tokenizer", field="tokenizer",
                   fix="give the served model's directory (config.json and tokenizer files) as the tokenizer")


@contextmanager
def _decode_logs(state: ClusterState) -> Iterator[tuple[LogPool | None, str]]:
    """The decode instances' logs while the block runs (command sources captured), or
    None and why they cannot all be read."""
    if state.managed:
        yield LogPool(tuple(cluster_info(state, decode=n).decode for n in state.by_role("decode"))), ""
        return
    with capturing_logs(cluster_info(state), every=True) as seen:
        decodes = tuple(i for i in seen.all_instances() if i.role == "decode")
        pool = LogPool(decodes)
        if not decodes:
            yield None, "the cluster lists no decode instance"
        elif not pool.complete:
            yield None, f"not observable: {pool.unobservable}"
        else:
            yield pool, ""


def run_serve_bench(name: str, opts: ServeOptions, progress: Progress = quiet) -> dict:
    """Drive `vllm bench serve` at cluster `name`'s endpoint and at a plain server; the report.

    Returns {"bench": "serve", "cluster", "load_tool", "params", "ratios",
    "ratio_definitions", "pd", "plain", "store", "outputs", "machine"}. The
    plain server, when launched here, is stopped however the run ends.
    Raises BadInput (an unknown cluster, no endpoint, a bad option, a plain
    URL that is not a healthy server of the same model), RuntimeFailure (the
    tool or the plain server failed).
    """
    opts = check_options(opts)
    state = _pd_cluster(name, "name")
    others = [_pd_cluster(other, "compare") for other in opts.compare]
    for other in others:
        if other.served_model_name != state.served_model_name:
            raise BadInput(f"cluster {other.name!r} serves {other.served_model_name!r}, {name!r} serves "
                           f"{state.served_model_name!r}: the targets must run one model", field="compare",
                           fix="compare clusters launched with the same model")
    tokenizer = _tokenizer_for(state, opts)
    if opts.plain_url is not None:
        check_plain_url(opts.plain_url, state.served_model_name)
    served = state.served_model_name
    api_key = cluster_api_key(name)
    with signals_interrupt(), tempfile.TemporaryDirectory(prefix="kvctl-bench-serve-") as tmp:
        work = Path(tmp)
        plain_ctx = plain_server(state, progress) if opts.plain_url is None else _given(opts.plain_url)
        with plain_ctx as plain_url:
            pd_raw, store = _pd_run("pd", state, served, tokenizer, opts, work, progress, api_key)
            compared_raw = [(other, *_pd_run(f"pd-{other.name}", other, served, tokenizer, opts, work, progress,
                                             cluster_api_key(other.name)))
                            for other in others]
            plain_raw = run_tool("plain", plain_url, served, tokenizer, opts, work, progress, api_key)
    pd, plain = target_figures(pd_raw, state.endpoint), target_figures(plain_raw, plain_url)
    pd["store_fraction"] = store["fraction"]
    plain["launched"] = opts.plain_url is None
    compared = []
    for other, raw, other_store in compared_raw:
        figures = target_figures(raw, other.endpoint or "")
        figures["store_fraction"] = other_store["fraction"]
        compared.append({"cluster": other.name, "transfer": transfer_of(other), "figures": figures,
                         "ratios": ratios_of(figures, plain), "store": other_store,
                         "outputs": same_outputs(raw, plain_raw)})
    return {
        "bench": "serve",
        "cluster": name,
        "load_tool": {"name": LOAD_TOOL, "version": _tool_version(),
                      "backend": "vllm (streamed /v1/completions)", "dataset": "random"},
        "params": {"requests": opts.requests, "concurrency": opts.concurrency,
                   "request_rate": opts.request_rate, "input_len": opts.input_len,
                   "output_len": opts.output_len, "seed": opts.seed, "model": served,
                   "tokenizer": str(tokenizer)},
        "ratios": ratios_of(pd, plain),
        "ratio_definitions": dict(RATIO_DEFINITIONS),
        "pd": pd,
        "plain": plain,
        "store": store,
        "outputs": same_outputs(pd_raw, plain_raw),
        "transfer": transfer_of(state),
        "compared": compared,
        "machine": machine_info(),
    }


def transfer_of(state: ClusterState) -> str:
    """What carries a cluster's KV P->D, as the table names it: nixl, fs, or P's connector."""
    cfg = next((r.kv_transfer_config for r in state.instances.values() if r.role == "prefill"), None)
    if handshake_connector(cfg) is not None:
        return "nixl"
    return "fs" if transfer_store(cfg, "send") is not None else (transfer_connector(cfg, "send") or "none")


def _pd_cluster(name: str, field: str) -> ClusterState:
    """Cluster `name`, with a healthy endpoint. Raises BadInput naming `field`, RuntimeFailure."""
    state = load_cluster(name)
    if not state.endpoint:
        raise BadInput(f"cluster {name!r} has no endpoint (no router in front of P and D)", field=field,
                       fix="launch it with its router (the default), or attach it with the router's URL "
                           "as its endpoint")
    if not _healthy(state.endpoint):
        raise RuntimeFailure(f"cluster {name!r}'s endpoint {state.endpoint} does not answer /health with 200",
                             where=state.endpoint, fix="`kvctl status` shows which instance is down")
    return state


def _pd_run(label: str, state: ClusterState, served: str, tokenizer: Path, opts: ServeOptions, work: Path,
            progress: Progress, api_key: str | None) -> tuple[dict, dict]:
    """The tool at one P/D cluster's endpoint: its raw result and what D served from the transfer."""
    _wait_endpoint(label, state, progress)
    with _decode_logs(state) as (logs, why_not):
        offsets = logs.offset() if logs is not None else ()
        raw = run_tool(label, state.endpoint, served, tokenizer, opts, work, progress, api_key)
        return raw, _store_after(logs, offsets, why_not, opts.requests + 1)


def _wait_endpoint(label: str, state: ClusterState, progress: Progress) -> None:
    """Wait until cluster `state`'s endpoint answers /health with 200 (its router has a healthy P and D).

    Its router checks each instance every second with a short timeout, so on a starved host (the
    plain server starting beside the clusters) it may hold none healthy for a while: a load run
    started then gets only 503s. Raises RuntimeFailure when it is not back within ENDPOINT_READY_S.
    """
    with httpx.Client() as client:
        if answers_health(client, state.endpoint):
            return
    progress(f"{label}: waiting for {state.endpoint} to answer /health (its router holds no healthy P or D)")
    try:
        wait_healthy({"endpoint": (state.endpoint, lambda: None)}, ENDPOINT_READY_S)
    except NotHealthy:
        raise RuntimeFailure(f"cluster {state.name!r}'s endpoint {state.endpoint} did not answer /health with 200 "
                             f"within {ENDPOINT_READY_S:g} s", where=state.endpoint,
                             fix="`kvctl status` shows which instance is down") from None


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


def _store_after(logs: LogPool | None, offsets: tuple[int, ...], why_not: str, sent: int) -> dict:
    """The store fraction of the run just done (waiting briefly for D's last log lines)."""
    if logs is None:
        return {"fraction": None, "served_from_store": None, "decode_requests": None,
                "source": None, "reason": why_not}
    deadline = time.monotonic() + LOG_WAIT_S
    result = store_fraction(logs.read_from(offsets), sent)
    while (result["fraction"] is None or result["fraction"] < 1.0) and time.monotonic() < deadline:
        time.sleep(0.25)  # log lines land after the HTTP answers
        result = store_fraction(logs.read_from(offsets), sent)
    return {**result, "reason": result.get("reason")}


def _tool_version() -> str | None:
    """The rig's vLLM version, from its dist-info (no vLLM import)."""
    try:
        python = rig_python()
    except BadInput:
        return None
    for site in sorted(python.parent.parent.glob("lib/python*/site-packages")):
        for dist in site.glob("vllm-*.dist-info"):
            return dist.name[len("vllm-"):-len(".dist-info")]
    return None
