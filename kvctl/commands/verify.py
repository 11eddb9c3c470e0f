"""`kvctl verify`: send requests through P then D and prove the KV travelled."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvctl.errors import BadInput, ExitCode
from kvctl.options import JSON_OPT
from kvctl.verify import evals
from kvctl.verify.checks import COMPARE_EXACT, COMPARE_MODES, DEFAULT_EPSILON
from kvctl.verify.cluster_info import load_cluster_info
from kvctl.verify.junit import write_verify_junit
from kvctl.verify.load_mode import LoadReport, generate_prompts, run_load
from kvctl.verify.prompts import DEFAULT_PROMPTS, check_prompts, load_prompts_file
from kvctl.verify.report import REQUIRE_ALL, REQUIRE_CHOICES
from kvctl.verify.verifier import DEFAULT_MAX_TOKENS, verify_cluster
from kvctl.views.output import Output
from kvctl.views.verify import render_eval, render_load, render_verify_report, request_bar


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def verify(
    name: str = typer.Option("default", "--name", help="Cluster name (see `kvctl status`)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="A prompt; repeat for several."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts", help="File of prompts: a JSON list of strings, or one per line."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", help=f"Tokens D (and the baseline) generate (default {DEFAULT_MAX_TOKENS}; "
                                   "with --eval, the set's)."),
    eval_set: Optional[str] = typer.Option(
        None, "--eval", help="Accuracy gate: send this eval set's prompts (built in: "
                             f"{', '.join(evals.EVAL_SETS)}; or a JSON file), score D's and the baseline's "
                             "answers, fail when P/D accuracy < baseline accuracy - --eval-tolerance."),
    eval_tolerance: float = typer.Option(evals.DEFAULT_TOLERANCE, "--eval-tolerance",
                                         help="Absolute accuracy P/D may lose against the baseline."),
    compare: str = typer.Option(COMPARE_EXACT, "--compare",
                                help="exact (default; CPU runs are deterministic): D's tokens equal the "
                                     "baseline's. tolerant (GPU): also pass a divergence where the baseline's "
                                     "top-2 logprobs differ by < --epsilon and D took the runner-up."),
    epsilon: float = typer.Option(DEFAULT_EPSILON, "--epsilon", help="tolerant: the near-tie gap, in nats."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Clients sending requests at once (load mode "
                                                                    "when > 1)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Generate this many distinct prompts "
                                                                           "(load mode)."),
    require: str = typer.Option(REQUIRE_ALL, "--require",
                                help="all: a check kvctl cannot observe (an attached cluster without a log source "
                                     "or a visible store) fails; observable: it is reported, and does not fail."),
    prefill: Optional[str] = typer.Option(None, "--prefill", help="The prefill instance requests go to (a pool's "
                                                                  "instance name; default: the first)."),
    decode: Optional[str] = typer.Option(None, "--decode", help="The decode instance (default: the first)."),
    via_endpoint: Optional[bool] = typer.Option(
        None, "--via-endpoint/--direct",
        help="--via-endpoint: each request once through the cluster's endpoint (its router), evidence from the "
             "logs of the P and D its X-Kvctl-Prefill/-Decode headers name (every instance's log when it names "
             "none); --direct: P then D from here, as the seed's curl did. Default: the endpoint when the "
             "cluster has one."),
    json_out: bool = JSON_OPT,
    junit_xml: Optional[Path] = typer.Option(None, "--junit-xml", help="Also write JUnit XML here."),
) -> None:
    """Verify a running cluster: P sends KV, the store holds it, D skips its prefill, outputs match.

    Per prompt: tokenize on P, P with max_tokens=1, D with --max-tokens, and a
    baseline (P with --max-tokens). Exit 0 if every check passes, 1 if any fails.
    Load mode (--requests N and/or --concurrency C > 1): C clients at once, a
    failed request is counted instead of stopping the run, and the report adds
    throughput, p50/p99 latency of P and D, transfer bytes and every mismatch.
    On an attached cluster, a check whose evidence is out of reach (no log
    source, store not visible) is reported as not observable, with the reason;
    --require decides whether that fails the run (default: it does).
    A cluster with an endpoint (kvctl's router, started by launch) is verified
    through it by default: each request once through the router (P, then D, as
    clients do), checked the same way against a baseline from P; --direct sends
    to P and D from here instead. Through the router, the report says which P
    and which D served each request and how many requests each instance
    served, and fails when an instance of a pool served none (checked when
    there are at least as many requests as instances in that pool).
    Every request carries the cluster's API key when it has one (launched with
    --api-key; an attached cluster's key comes from $KVCTL_API_KEY).
    """
    out = Output(json_mode=json_out)
    if prompt and prompts_file:
        raise BadInput("--prompt and --prompts both given", where="--prompt / --prompts",
                       fix="pass prompts one way: repeated --prompt TEXT, or --prompts FILE")
    if compare not in COMPARE_MODES:
        raise BadInput(f"unknown --compare {compare!r}", where="--compare",
                       fix=f"use one of: {', '.join(COMPARE_MODES)}")
    if require not in REQUIRE_CHOICES:
        raise BadInput(f"unknown --require {require!r}", where="--require",
                       fix=f"use one of: {', '.join(REQUIRE_CHOICES)}")
    if requests is not None and (prompt or prompts_file):
        raise BadInput("--requests generates its prompts; --prompt/--prompts give them",
                       where="--requests / --prompt / --prompts", fix="drop one of them")
    load_mode = requests is not None or concurrency > 1
    chosen = evals.load_eval(eval_set) if eval_set is not None else None
    if chosen is not None and (prompt or prompts_file or load_mode):
        raise BadInput("--eval sends its own prompts, one request at a time",
                       where="--eval / --prompt / --prompts / --requests / --concurrency",
                       fix="drop --eval, or the other prompt and load options")
    if max_tokens is None:
        max_tokens = chosen.max_tokens if chosen is not None else DEFAULT_MAX_TOKENS
    if chosen is not None:
        prompts = chosen.prompts
    elif requests is not None:
        prompts = generate_prompts(requests)
    elif prompts_file is not None:
        prompts = load_prompts_file(prompts_file)
    elif prompt:
        prompts = check_prompts(prompt)
    else:
        prompts = list(DEFAULT_PROMPTS)
    info = load_cluster_info(name, prefill=prefill, decode=decode)
    if via_endpoint is None:
        via_endpoint = info.endpoint is not None

    with request_bar(out, name, len(prompts)) as progress:
        if load_mode:
            result = run_load(info, prompts, max_tokens, concurrency, progress, require=require,
                              via_endpoint=via_endpoint, compare=compare, epsilon=epsilon)
            report = result.verify
        else:
            result = report = verify_cluster(info, prompts, max_tokens, progress, require=require,
                                             via_endpoint=via_endpoint, compare=compare, epsilon=epsilon)

    scored = evals.score_report(chosen, report, eval_tolerance) if chosen is not None else None
    if junit_xml is not None:
        write_verify_junit(report, junit_xml)
    if json_out:
        doc = result.to_json()
        if scored is not None:
            doc["eval"] = scored.to_json()
            doc["passed"] = result.passed and scored.passed
        out.emit_json(doc)
    elif isinstance(result, LoadReport):
        render_load(result, out.stdout)
    else:
        render_verify_report(report, out.stdout)
        if scored is not None:
            render_eval(scored, out.stdout)
    if not json_out and junit_xml is not None:
        out.info(f"JUnit XML written to {junit_xml}")
    if not result.passed or (scored is not None and not scored.passed):
        raise typer.Exit(int(ExitCode.CHECK_FAILED))
