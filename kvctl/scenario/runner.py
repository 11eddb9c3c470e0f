"""Run a scenario: launch → verify → inspect-store → down, always tearing down.

A scenario with `cluster: {attach: FILE}` launches nothing: its `launch` phase
attaches the running cluster the file describes (under the scenario's name),
and its `down` phase detaches it; the servers keep running. Its `inspect`
phase needs the store to be visible here; when it is not, the phase says so
(not observable) and fails only under `expectations.require: all`.

`plan_scenario` turns a Scenario into a ClusterSpec (runtime, model, store,
resolved configs) and starts nothing: every problem it finds is a BadInput,
raised before any server exists. `run_scenario` then runs the four phases,
each timed, and returns a ScenarioReport. Teardown runs whatever happens:
failed checks, a launch or verify error, Ctrl-C, SIGTERM or SIGHUP (the
report then says `interrupted`). Errors after the plan do not propagate;
they are recorded in the report, whose `exit_code` the CLI exits with.

Report JSON (a contract, like verify's):

    {"scenario": str, "passed": bool, "exit_code": int,
     "phases": [{"name": "launch"|"verify"|"inspect"|"down",
                 "status": "passed"|"failed"|"interrupted"|"skipped", "seconds": float|null,
                 "detail": str}],
     "verify": <kvctl verify --json object> | null,
     "store": <kvctl inspect-store --json object> | null,
     "wall_s": float, ...}

Library code: nothing here prints; progress goes to a ScenarioProgress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvctl.attach.attach import AttachSpec, attach_cluster, detach_cluster, spec_from_file
from kvctl.cluster.lifecycle import LaunchProgress, down, restart_instances, running_cluster
from kvctl.cluster.lmcache import LMCacheOptions
from kvctl.signals import signals_interrupt
from kvctl.cluster.spec import ClusterSpec, build_1p1d_spec, build_pd_spec
from kvctl.cluster.state import ATTACHED_RUNTIME, ClusterState, cluster_dir
from kvctl.errors import BadInput, ExitCode, KvctlError
from kvctl.paths import kvctl_home
from kvctl.runtime import runtime_class, select_runtime
from kvctl.runtime.docker_options import docker_options
from kvctl.scenario.schema import Scenario, scenario_path
from kvctl.store.inspect import StoreReport, inspect_store
from kvctl.verify.junit import add_case, finish, new_tree, verify_junit, write_junit
from kvctl.verify.prompts import check_prompts
from kvctl.verify.report import REQUIRE_OBSERVABLE, VerifyReport
from kvctl.verify.evals import EvalReport, load_eval, score_report
from kvctl.verify.checks import offload_tokens
from kvctl.verify.verifier import RunOptions, expected_send_children, run_verify

log = logging.getLogger(__name__)

PHASES = ("launch", "verify", "inspect", "down")
SECOND_ROUND = "second_round"  # a phase of scenarios with `second_round`, after verify
KEPT_ROOT = "scenario-runs"  # under $KVCTL_HOME: what `keep` keeps (store and logs)


class ScenarioProgress:
    """Callbacks for a running scenario; the defaults do nothing. The CLI overrides them."""

    def phase_started(self, phase: PhaseResult) -> None: ...

    def phase_finished(self, phase: PhaseResult) -> None: ...

    def launch(self, progress: LaunchProgress) -> None: ...

    def request(self, index: int, total: int, stage: str) -> None: ...


@dataclass
class PhaseResult:
    name: str
    status: str = "skipped"  # skipped (never ran) | running | passed | failed | interrupted
    seconds: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "detail": self.detail}


@dataclass(frozen=True)
class ScenarioPlan:
    """A scenario resolved for this machine: what will be launched and checked."""

    scenario: Scenario
    source: str | None  # the scenario file, for messages
    spec: ClusterSpec | None  # None: the scenario attaches (see `attach`)
    runtime_reason: str
    prompts: list[str]
    send_children: list[tuple[int, str]] | None  # None: verify derives them from P's config
    kept_dir: Path | None  # keep: store and logs end up here
    attach: AttachSpec | None = None  # `cluster: {attach: FILE}`: the running cluster to verify

    @property
    def cluster(self) -> str:
        return self.attach.name if self.attach is not None else self.spec.name  # type: ignore[union-attr]

    @property
    def runtime(self) -> str:
        return ATTACHED_RUNTIME if self.attach is not None else self.spec.runtime  # type: ignore[union-attr]


@dataclass
class ScenarioReport:
    scenario: str
    source: str | None
    cluster: str
    runtime: str
    runtime_reason: str
    expected_checks: list[str]
    phases: dict[str, PhaseResult] = field(default_factory=lambda: {p: PhaseResult(p) for p in PHASES})
    verify: VerifyReport | None = None
    eval: EvalReport | None = None  # the `eval:` block's accuracy gate
    second_round: SecondRoundReport | None = None  # scenarios with `second_round` (its own phase)
    store: StoreReport | None = None
    error: KvctlError | None = None  # what stopped the run early (launch or verify), if anything
    interrupted: bool = False
    kept: str | None = None
    wall_s: float = 0.0
    engines: dict[str, str] | None = None  # the vLLM engine of each role (None: an attached cluster)

    def failed_checks(self) -> list[tuple[int, str, str]]:
        """(request index, check name, evidence) of every expected check that failed."""
        if self.verify is None:
            return []
        return _failed(self.verify, self.expected_checks)

    @property
    def engine(self) -> str | None:
        """P's and D's engine when they share one, else "mixed" (None: attached)."""
        if not self.engines:
            return None
        used = set(self.engines.values())
        return used.pop() if len(used) == 1 else "mixed"

    @property
    def passed(self) -> bool:
        return (self.error is None and not self.interrupted
                and all(p.status == "passed" for p in self.phases.values()))

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return int(ExitCode.INTERRUPTED)
        if self.error is not None:
            return int(self.error.exit_code)  # RuntimeFailure: 3
        return int(ExitCode.OK if self.passed else ExitCode.CHECK_FAILED)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "source": self.source, "cluster": self.cluster,
            "runtime": self.runtime, "runtime_reason": self.runtime_reason,
            "engine": self.engine, "engines": self.engines,
            "passed": self.passed, "exit_code": self.exit_code, "interrupted": self.interrupted,
            "expected_checks": self.expected_checks,
            "phases": [p.to_json() for p in self.phases.values()],
            "verify": self.verify.to_json() if self.verify else None,
            "eval": self.eval.to_json() if self.eval else None,
            **({"second_round": self.second_round.to_json()} if self.second_round else {}),
            "store": self.store.to_json() if self.store else None,
            "error": self.error.to_json() if self.error else None,
            "kept": self.kept, "wall_s": round(self.wall_s, 3),
        }


def _failed(verify: VerifyReport, expected: list[str]) -> list[tuple[int, str, str]]:
    """(request index, check name, evidence) of every expected check of `verify` that failed."""
    allowed = verify.require == REQUIRE_OBSERVABLE  # then a check not observable is no failure
    return [(i, c.name, c.evidence) for i, r in enumerate(verify.requests) for c in r.checks
            if c.name in expected and not c.passed and (c.observable or not allowed)]


@dataclass
class SecondRoundReport:
    """The prompts verified again after restarting instances: what changed, measured.

    `retrieved`/`stored`: tokens the prefills' LMCache servers logged as retrieved and stored,
    before and after this round (their logs' totals); `ttft`: each prompt's prefill latency
    (P's time to its first token) in the first round and in this one.
    """

    restarted: list[str]
    restart_s: float
    verify: VerifyReport
    retrieved: tuple[int, int]  # (before, after) this round
    stored: tuple[int, int]
    ttft: list[tuple[int, float | None, float | None]]  # (prompt tokens, round 1 s, round 2 s)
    outputs_unchanged: bool

    @property
    def retrieved_rose(self) -> bool:
        return self.retrieved[1] > self.retrieved[0]

    def to_json(self) -> dict[str, Any]:
        pairs = [(a, b) for _, a, b in self.ttft if a and b]
        return {"restarted": self.restarted, "restart_s": round(self.restart_s, 3),
                "passed": self.verify.passed, "outputs_unchanged": self.outputs_unchanged,
                "lmcache": {"retrieved_tokens": {"before": self.retrieved[0], "after": self.retrieved[1]},
                            "stored_tokens": {"before": self.stored[0], "after": self.stored[1]},
                            "retrieved_rose": self.retrieved_rose},
                "ttft": [{"prompt_tokens": n, "first_round_s": _r(a), "second_round_s": _r(b),
                          "ratio": _r(b / a) if a and b else None} for n, a, b in self.ttft],
                "ttft_ratio_total": _r(sum(b for _, b in pairs) / sum(a for a, _ in pairs)) if pairs else None,
                "verify": self.verify.to_json()}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


# ---------------------------------------------------------------- plan


def _in_scenario(e: KvctlError, source: str | None) -> KvctlError:
    """The same error, located in the scenario: its fields as scenario paths, after the file."""
    e.locate(scenario_path)
    e.where = f"{source}: {e.where}" if source and e.where else (e.where or source)
    return e


def _send_children(scenario: Scenario, prefill_config: dict) -> list[tuple[int, str]] | None:
    """(child index, name) pairs for `expectations.sent_to_connectors`, in P's child order.

    Names map to P's sending children in order, so [FSConnector, FSConnector]
    means both FSConnector children. Raises BadInput when P has fewer.
    """
    names = scenario.expectations.sent_to_connectors
    if names is None:
        return None
    available = expected_send_children(prefill_config)  # connectors.config.topology's rule
    picked: list[tuple[int, str]] = []
    for i, name in enumerate(names):
        child = next((c for c in available if c[1] == name and c not in picked), None)
        if child is None:
            count = sum(1 for c in available if c[1] == name)
            raise BadInput(f"expects {names.count(name)} `sent to connector {name}` lines per request, "
                           f"but P has {count} sending {name} child{'ren' if count != 1 else ''}",
                           where=f"$.expectations.sent_to_connectors[{i}]",
                           fix="list each sending child of P once, in config order")
        picked.append(child)
    return sorted(picked)


def plan_scenario(scenario: Scenario, *, keep: bool = False, source: str | None = None) -> ScenarioPlan:
    """Resolve `scenario` for this machine. Starts nothing.

    The runtime goes through `select_runtime` (as `kvctl launch` does);
    `model: tiny` is the generated tiny model; `${store}` is `store`, or a
    fresh dir (in the cluster dir, or under $KVCTL_HOME/scenario-runs with
    `keep`); `${instance_dir}` is a per-role dir in the cluster dir.
    Raises BadInput, located at the scenario field (`source: $.model`), for a
    runtime this kvctl cannot run, a missing model, an invalid config or
    empty prompts.
    """
    try:
        return _plan(scenario, keep, source)
    except BadInput as e:
        raise _in_scenario(e, source) from None


def _plan_attach(scenario: Scenario, keep: bool, source: str | None) -> ScenarioPlan:
    """An attaching scenario: its attach file, read now (relative to the scenario file)."""
    assert scenario.cluster is not None
    expanded = os.path.expandvars(scenario.cluster.attach)
    unset = re.findall(r"\$\{?(\w+)", expanded)
    if unset:
        raise BadInput(f"$.cluster.attach uses ${unset[0]}, which is not set", where="$.cluster.attach",
                       fix=f"export {unset[0]}=<directory> before running the scenario")
    path = Path(expanded).expanduser()
    if not path.is_absolute() and source:
        path = Path(source).parent / path
    attach = spec_from_file(path, scenario.name)
    prompts = check_prompts(scenario.prompt_texts(), where=scenario_path("prompts") or "prompts")
    p_config = next((i.kv_transfer_config for i in attach.instances if i.role == "prefill"), None)
    kept_dir = None
    if keep:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        kept_dir = kvctl_home() / KEPT_ROOT / f"{scenario.name}-{stamp}"
    return ScenarioPlan(scenario=scenario, source=source, spec=None,
                        runtime_reason=f"attached: {path} (not started by kvctl)", prompts=prompts,
                        send_children=_send_children(scenario, p_config or {}), kept_dir=kept_dir,
                        attach=attach)


def _plan(scenario: Scenario, keep: bool, source: str | None) -> ScenarioPlan:
    if scenario.attaches:
        return _plan_attach(scenario, keep, source)
    try:
        runtime, why = select_runtime(scenario.runtime)
    except BadInput as e:
        raise BadInput(f"scenario {scenario.name} needs the {scenario.runtime} runtime: {e.what}",
                       field="runtime",
                       fix=e.fix or (f"run it where kvctl can use the {scenario.runtime} runtime, or run a "
                                     "local (CPU) scenario such as smoke-1p1d")) from None
    name = scenario.name
    cdir = cluster_dir(name)
    kept_dir = None
    if keep:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        kept_dir = kvctl_home() / KEPT_ROOT / f"{name}-{stamp}"
    if scenario.store is not None:
        store = Path(_expand(scenario.store, "store")).expanduser().resolve()
    else:
        store = (kept_dir or cdir) / "store"
    configs = {role: scenario.resolved_config(role, str(store), str(cdir / "instances" / role))
               for role in ("prefill", "decode")}
    prompts = check_prompts(scenario.prompt_texts(), where=scenario_path("prompts") or "prompts")
    options = dict(
        name=name, runtime=runtime,
        model=None if scenario.model == "tiny" else Path(_expand(scenario.model, "model")),
        served_model_name=scenario.served_model_name,
        prefill_config=configs["prefill"], decode_config=configs["decode"], store=store,
        timeout_s=scenario.timeout,
        prefill_args=tuple(scenario.role("prefill").args), decode_args=tuple(scenario.role("decode").args),
        prefill_env=scenario.role("prefill").env, decode_env=scenario.role("decode").env,
        docker=_docker_options(scenario) if runtime_class(runtime).docker_options else None,
        prefill_engine=scenario.role("prefill").engine or scenario.engine,
        decode_engine=scenario.role("decode").engine or scenario.engine,
        lmcache=LMCacheOptions(**scenario.lmcache.model_dump()))
    counts = {role: scenario.role(role).count for role in ("prefill", "decode")}
    if any(n > 1 for n in counts.values()):  # xPyD: instances named prefill-0, ..., decode-0, ...
        spec = build_pd_spec(prefill=counts["prefill"], decode=counts["decode"], **options)
    else:
        spec = build_1p1d_spec(**options)  # type: ignore[arg-type]
    children = _send_children(scenario, configs["prefill"])
    return ScenarioPlan(scenario=scenario, source=source, spec=spec, runtime_reason=why, prompts=prompts,
                        send_children=children, kept_dir=kept_dir)


def _expand(value: str, field: str) -> str:
    """$VARS in model/store paths (nightly CI points them at its model cache); unset = BadInput."""
    expanded = os.path.expandvars(value)
    missing = re.findall(r"\$\{?(\w+)", expanded)
    if missing:
        raise BadInput(f"{scenario_path(field)} uses ${missing[0]}, which is not set", field=field,
                       fix=f"export {missing[0]}=<directory> before running the scenario")
    return expanded


def _docker_options(scenario: Scenario):
    return docker_options(image=scenario.image, gpus=scenario.gpus,
                          prefill_host=scenario.role("prefill").docker_host,
                          decode_host=scenario.role("decode").docker_host)


# ---------------------------------------------------------------- run


class _Phases:
    """Times each phase and records how it ended; the caller's exception still propagates."""

    def __init__(self, report: ScenarioReport, progress: ScenarioProgress):
        self.report = report
        self.progress = progress

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[PhaseResult]:
        phase = self.report.phases[name]
        phase.status, phase.detail = "running", ""
        self.progress.phase_started(phase)
        t0 = time.monotonic()
        try:
            yield phase
        except KeyboardInterrupt:
            phase.status, phase.detail = "interrupted", "interrupted (Ctrl-C or a termination signal)"
            raise
        except KvctlError as e:
            phase.status, phase.detail = "failed", e.what
            raise
        except BaseException as e:
            phase.status, phase.detail = "failed", f"{type(e).__name__}: {e}"
            raise
        else:
            if phase.status == "running":
                phase.status = "passed"
        finally:
            phase.seconds = time.monotonic() - t0
            self.progress.phase_finished(phase)


def _verify(state: ClusterState, plan: ScenarioPlan, progress: ScenarioProgress) -> VerifyReport:
    """The verify driver, one request at a time, with the scenario's expected send children;
    through the cluster's endpoint when it has one (unless the scenario says `via: direct`)."""
    options = _run_options(state, plan, plan.scenario.max_tokens)
    return run_verify(state, plan.prompts, options, progress.request).report


def _run_options(state: ClusterState, plan: ScenarioPlan, max_tokens: int) -> RunOptions:
    exp = plan.scenario.expectations
    return RunOptions(max_tokens=max_tokens, send_children=plan.send_children, require=exp.require,
                      via_endpoint=plan.scenario.via == "endpoint" and bool(state.endpoint),
                      compare=exp.compare, epsilon=exp.epsilon)


def _eval(state: ClusterState, plan: ScenarioPlan, progress: ScenarioProgress) -> EvalReport:
    """The `eval:` block: its set's prompts through the same driver, scored against the baseline."""
    spec = plan.scenario.eval
    assert spec is not None
    chosen = load_eval(spec.set)
    options = _run_options(state, plan, spec.max_tokens or chosen.max_tokens)
    run = run_verify(state, chosen.prompts, options, progress.request).report
    return score_report(chosen, run, spec.tolerance)


def _keep_logs(plan: ScenarioPlan) -> None:
    """Copy the servers' logs into the kept dir (down removes the cluster dir)."""
    assert plan.kept_dir is not None
    logs = cluster_dir(plan.cluster) / "logs"
    if logs.is_dir():
        shutil.copytree(logs, plan.kept_dir / "logs", dirs_exist_ok=True)


def _down(plan: ScenarioPlan, stack: contextlib.ExitStack | None) -> None:
    if plan.kept_dir is not None:
        _keep_logs(plan)
    if stack is not None:
        stack.close()  # running_cluster's teardown: signals ignored until it is done
    else:
        down(plan.cluster)  # after a failed launch: its logs and dirs


def _verdict(verify: VerifyReport, expected: list[str]) -> str:
    """Why a verify failed ("" when it passed)."""
    failed = _failed(verify, expected)
    never = verify.run_failures()  # a pool member that served no request
    why = [f"{len(failed)} failed checks: {', '.join(sorted({n for _, n, _ in failed}))}"] if failed else []
    return "; ".join(why + [f"{f.instance} never served" for f in never])


def _offload_totals(state: ClusterState) -> tuple[int, int]:
    """(retrieved, stored) tokens over the logs of the cluster's LMCache servers."""
    totals = [0, 0]
    for rec in state.lmcache.values():
        try:
            text = Path(rec["log_path"]).read_text(errors="replace")
        except OSError:
            continue
        stored, retrieved = offload_tokens(text)
        totals[0] += retrieved
        totals[1] += stored
    return totals[0], totals[1]


def _second_round(state: ClusterState, plan: ScenarioPlan, report: ScenarioReport,
                  progress: ScenarioProgress) -> tuple[ClusterState, SecondRoundReport]:
    """Restart the instances of the roles `second_round.restart` names, then verify again."""
    assert plan.spec is not None and plan.scenario.second_round is not None and report.verify is not None
    roles = plan.scenario.second_round.restart
    names = [n for n, rec in state.instances.items() if rec.role in roles]
    before = _offload_totals(state)
    t0 = time.monotonic()
    state = restart_instances(plan.spec, names, progress.launch)
    restart_s = time.monotonic() - t0
    verify = _verify(state, plan, progress)
    after = _offload_totals(state)
    first = report.verify.requests
    ttft = [(b.prompt_tokens, a.prefill_latency_s, b.prefill_latency_s) for a, b in zip(first, verify.requests)]
    unchanged = len(first) == len(verify.requests) and all(
        a.decode_output == b.decode_output and a.baseline_output == b.baseline_output
        for a, b in zip(first, verify.requests))
    return state, SecondRoundReport(names, restart_s, verify, (before[0], after[0]), (before[1], after[1]),
                                    ttft, unchanged)


def _verify_and_inspect(state: ClusterState, plan: ScenarioPlan, report: ScenarioReport, phases: _Phases,
                        progress: ScenarioProgress) -> None:
    with phases.run("verify") as phase:
        report.verify = _verify(state, plan, progress)
        why = _verdict(report.verify, report.expected_checks)
        if why:
            phase.status, phase.detail = "failed", why
        if plan.scenario.eval is not None:
            report.eval = _eval(state, plan, progress)
            if not report.eval.passed:
                phase.status = "failed"
                phase.detail = "; ".join(filter(None, [phase.detail, report.eval.verdict()]))
    if plan.scenario.second_round is not None and plan.spec is not None:
        with phases.run(SECOND_ROUND) as phase:
            state, report.second_round = _second_round(state, plan, report, progress)
            rnd = report.second_round
            why = _verdict(rnd.verify, report.expected_checks)
            problems = [why] if why else []
            if not rnd.outputs_unchanged:
                problems.append("outputs differ from the first round's")
            if state.lmcache and not rnd.retrieved_rose:
                problems.append(f"the LMCache servers retrieved nothing more ({rnd.retrieved[0]} tokens before, "
                                f"{rnd.retrieved[1]} after)")
            if problems:
                phase.status, phase.detail = "failed", "; ".join(problems)
            else:
                phase.detail = (f"restarted {', '.join(rnd.restarted)} in {rnd.restart_s:.1f} s; LMCache retrieved "
                                f"{rnd.retrieved[1] - rnd.retrieved[0]} more tokens; outputs unchanged")
    with phases.run("inspect") as phase:
        if state.store is None:  # attached without a visible store
            phase.detail = "not observable: the store is not visible from this host"
            if plan.scenario.expectations.require == "all":
                phase.status = "failed"
            return
        report.store = inspect_store(Path(state.store), verify=True)
        if report.store.problems:
            phase.status = "failed"
            phase.detail = (f"{len(report.store.invalid)} invalid entries, "
                            f"{len(report.store.temp_files)} temp files")


def _run_attached(plan: ScenarioPlan, report: ScenarioReport, phases: _Phases,
                  progress: ScenarioProgress) -> None:
    """Attach (the launch phase), verify, inspect, and always detach (the down phase)."""
    assert plan.attach is not None
    with phases.run("launch") as phase:
        result = attach_cluster(plan.attach)  # BadInput (name taken, file wrong): nothing to undo
        phase.detail = "; ".join(["attached, not started by kvctl", *result.notes])
    try:
        _verify_and_inspect(result.state, plan, report, phases, progress)
    finally:
        with phases.run("down") as phase:
            if plan.kept_dir is not None:
                _keep_logs(plan)
            detach_cluster(plan.cluster)
            phase.detail = "detached; its servers keep running"


def _run_phases(plan: ScenarioPlan, report: ScenarioReport, phases: _Phases,
                progress: ScenarioProgress) -> None:
    if plan.attach is not None:
        return _run_attached(plan, report, phases, progress)
    assert plan.spec is not None
    with contextlib.ExitStack() as stack:
        try:
            with phases.run("launch"):
                state = stack.enter_context(running_cluster(plan.spec, progress.launch))
        except BadInput:
            raise  # refused before starting anything (e.g. the name is in use): nothing of ours to stop
        except BaseException:
            with phases.run("down"):  # launch stopped its servers; remove what is left
                _down(plan, None)
            raise
        try:
            _verify_and_inspect(state, plan, report, phases, progress)
        finally:
            with phases.run("down"):
                _down(plan, stack)


def _phases(scenario: Scenario) -> tuple[str, ...]:
    if scenario.second_round is None or scenario.attaches:
        return PHASES
    return PHASES[:2] + (SECOND_ROUND,) + PHASES[2:]


def run_scenario(scenario: Scenario, progress: ScenarioProgress | None = None, *, keep: bool = False,
                 source: str | None = None) -> ScenarioReport:
    """Launch, verify, inspect the store and tear down; returns the report.

    `keep` keeps the store and the server logs (under $KVCTL_HOME/scenario-runs);
    servers are always stopped. Raises BadInput before starting anything
    (see plan_scenario). Afterwards nothing is raised: launch or verify errors
    go to `report.error`, Ctrl-C/SIGTERM/SIGHUP to `report.interrupted`,
    and teardown has run in every case.
    """
    progress = progress or ScenarioProgress()
    plan = plan_scenario(scenario, keep=keep, source=source)
    report = ScenarioReport(scenario=scenario.name, source=source, cluster=plan.cluster,
                            phases={p: PhaseResult(p) for p in _phases(scenario)},
                            runtime=plan.runtime, runtime_reason=plan.runtime_reason,
                            expected_checks=list(scenario.expectations.checks),
                            engines=None if plan.spec is None else {"prefill": plan.spec.prefill.engine,
                                                                    "decode": plan.spec.decode.engine})
    t0 = time.monotonic()
    # SIGTERM/SIGHUP (e.g. a CI timeout) must tear down too, not only Ctrl-C.
    with signals_interrupt():
        try:
            _run_phases(plan, report, _Phases(report, progress), progress)
        except KeyboardInterrupt:
            report.interrupted = True
        except KvctlError as e:
            report.error = e
    report.wall_s = time.monotonic() - t0
    if plan.kept_dir is not None and plan.kept_dir.exists():
        report.kept = str(plan.kept_dir)
    return report


# ---------------------------------------------------------------- JUnit


def scenario_junit(report: ScenarioReport) -> ET.ElementTree:
    """verify's testcases (one per check per request) plus one per phase that did not pass.

    A launch failure thus still gives CI a failed testcase.
    """
    suite_name = f"kvctl scenario {report.scenario}"
    if report.verify is not None:
        tree = verify_junit(report.verify, suite_name=suite_name)
        suite = tree.getroot().find("testsuite")
    else:
        tree, suite = new_tree(suite_name)
    assert suite is not None
    for phase in report.phases.values():
        failure = skipped = None
        if phase.status in ("failed", "interrupted"):
            text = phase.detail
            if phase.name in ("launch", "verify") and report.error is not None:
                text = report.error.message + (f"\n{report.error.details}" if report.error.details else "")
            failure = (phase.status, phase.detail, text)
        elif phase.status == "skipped":
            skipped = "not reached"
        add_case(suite, f"kvctl.scenario.{report.scenario}", f"phase {phase.name}",
                 time=f"{phase.seconds or 0:.3f}", failure=failure, skipped=skipped)
    return finish(tree)


def write_scenario_junit(report: ScenarioReport, path: Path | str) -> Path:
    """Write the scenario's JUnit file. Raises BadInput when the path cannot be written."""
    return write_junit(scenario_junit(report), path)
