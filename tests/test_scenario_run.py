"""`kvctl scenario list|run`: launch → verify → inspect-store → down, always torn down.

The e2e tests run real vLLM server pairs from the CPU rig (each launch costs
30-60 s here, so there are few of them) and check with /proc that nothing is
left running and with $KVCTL_HOME that no cluster state is left. The plan and
report tests need no servers.
"""

from __future__ import annotations

import json
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from conftest import live_processes_under

from kvctl.errors import BadInput, RuntimeFailure
from kvctl.scenario.schema import Scenario, scenarios_dir
from kvctl.verify.checks import CHECKS
from kvctl.scenario import runner
from kvctl.scenario.runner import (
    PHASES,
    PhaseResult,
    ScenarioReport,
    plan_scenario,
    scenario_junit,
)


def e2e(test):
    """Starts real vLLM servers: slow, and one pair at a time under --dist loadgroup."""
    return pytest.mark.xdist_group("vllm")(pytest.mark.e2e(test))


RUN_TIMEOUT_S = 900  # subprocess limit for one scenario run (launch 30-60 s, verify seconds)


def shipped(name: str) -> dict:
    return yaml.safe_load((scenarios_dir() / f"{name}.yaml").read_text())


def write_scenario(tmp_path: Path, doc: dict, name: str = "custom") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return path


def assert_torn_down(home: Path) -> None:
    """No server process and no cluster left: nothing under clusters/, no live process under home."""
    assert live_processes_under(home) == []
    clusters = home / "clusters"
    assert not clusters.exists() or [p.name for p in clusters.iterdir() if not p.name.startswith(".")] == []


def checks_of(report: dict) -> list[tuple[int, str, bool]]:
    return [(i, c["name"], c["passed"]) for i, r in enumerate(report["verify"]["requests"]) for c in r["checks"]]


def phase_status(report: dict) -> dict[str, str]:
    return {p["name"]: p["status"] for p in report["phases"]}


# ---------------------------------------------------------------- list, bad input (no servers)


def test_list_shows_shipped_scenarios_and_where_they_run(kvctl):
    r = kvctl("scenario", "list", "--json")
    assert r.rc == 0, r
    rows = {row["name"]: row for row in json.loads(r.stdout)["scenarios"]}
    assert {"smoke-1p1d", "multi-1p1d", "seed-replica-gpu", "fs-1p1d-gpu", "pd-2p2d"} <= set(rows)
    assert rows["smoke-1p1d"]["runnable"] and rows["multi-1p1d"]["runnable"] and rows["pd-2p2d"]["runnable"]
    assert rows["pd-2p2d"]["shape"] == "2P2D" and rows["smoke-1p1d"]["shape"] == "1P1D"
    assert rows["smoke-1p1d"]["file"] == str(scenarios_dir() / "smoke-1p1d.yaml")
    assert all(row["valid"] for row in rows.values())
    human = kvctl("scenario", "list")
    assert human.rc == 0, human
    for name in rows:
        assert name in human.stdout


def test_invalid_scenario_exits_2_with_json_path_before_starting(kvctl, kvctl_home, tmp_path):
    doc = shipped("smoke-1p1d")
    doc["decode"]["kv_transfer_config"]["kv_connector"] = "FSConector"  # misspelt
    doc["max_tokenz"] = 3  # a typo'd key
    path = write_scenario(tmp_path, doc)
    r = kvctl("scenario", "run", str(path))
    assert r.rc == 2, r
    assert "$.decode.kv_transfer_config.kv_connector" in r.stderr and "$.max_tokenz" in r.stderr
    assert "Traceback" not in r.stderr
    j = kvctl("scenario", "run", str(path), "--json")
    assert j.rc == 2, j
    err = json.loads(j.stdout)  # the one object: the error
    assert err["exit_code"] == 2 and "$.decode.kv_transfer_config.kv_connector" in err["details"]
    assert not (kvctl_home / "clusters").exists()  # nothing was started


def test_unknown_scenario_name_lists_the_shipped_ones(kvctl):
    r = kvctl("scenario", "run", "no-such-scenario")
    assert r.rc == 2, r
    assert "unknown scenario 'no-such-scenario'" in r.stderr and "smoke-1p1d" in r.stderr


def test_gpu_scenario_without_its_model_cache_names_the_variable(kvctl, kvctl_home):
    """Nightly GPU scenarios read the model from $KVCTL_MODELS; unset here, they stop before starting anything."""
    kvctl.env.pop("KVCTL_MODELS", None)
    r = kvctl("scenario", "run", "fs-1p1d-gpu", "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert "$KVCTL_MODELS" in err["error"] and err["where"].endswith("$.model")
    assert "export KVCTL_MODELS=" in err["fix"]
    assert not (kvctl_home / "clusters").exists()


# ---------------------------------------------------------------- plan and report (no servers)


def test_plan_resolves_placeholders_children_and_store(kvctl_home, tiny_model):
    doc = shipped("multi-1p1d")
    doc["model"] = str(tiny_model)
    plan = plan_scenario(Scenario.model_validate(doc))
    cdir = kvctl_home / "clusters" / "multi-1p1d"
    assert plan.spec.name == "multi-1p1d" and plan.spec.runtime == "local"
    assert plan.spec.store == cdir / "store" and plan.kept_dir is None
    children = plan.spec.prefill.kv_transfer_config["kv_connector_extra_config"]["connectors"]
    assert children[0]["kv_connector_extra_config"]["fs_storage_path"] == str(cdir / "store")
    assert children[1]["kv_connector_extra_config"]["fs_storage_path"] == str(cdir / "instances/prefill/offload")
    assert plan.spec.decode.kv_transfer_config["kv_connector_extra_config"]["fs_storage_path"] == str(cdir / "store")
    assert plan.send_children == [(0, "FSConnector"), (1, "FSConnector")]
    assert plan.prompts[3] == "Hello, how are you?" * 67
    kept = plan_scenario(Scenario.model_validate(doc), keep=True)
    assert kept.spec.store == kept.kept_dir / "store"
    assert kept.kept_dir.parent == kvctl_home / "scenario-runs"
    assert not (kvctl_home / "clusters").exists()  # planning starts and creates nothing


def test_plan_of_pools_launches_xpyd_behind_the_router(kvctl_home, tiny_model):
    doc = shipped("pd-2p2d")
    doc["model"] = str(tiny_model)
    spec = plan_scenario(Scenario.model_validate(doc)).spec
    assert (spec.prefill_count, spec.decode_count, spec.pooled, spec.router) == (2, 2, True, True)
    assert [(i.name, i.role) for i in spec.instances()] == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]
    store = str(kvctl_home / "clusters" / "pd-2p2d" / "store")
    for role in ("prefill", "decode"):
        assert spec.role(role).kv_transfer_config["kv_connector_extra_config"]["fs_storage_path"] == store
    doc.update(prefill=1, decode=1)
    one = plan_scenario(Scenario.model_validate(doc)).spec
    assert [i.name for i in one.instances()] == ["prefill", "decode"] and not one.pooled


@pytest.mark.parametrize("edit, where, what", [
    (lambda d: d.update(model="/no/such/model"), "$.model", "model directory not found"),
    (lambda d: d.update(prompts=["ok", "   "]), "$.prompts[1]", "prompt 2 is empty"),
    (lambda d: d["expectations"].update(sent_to_connectors=["FSConnector"] * 3),
     "$.expectations.sent_to_connectors[2]", "P has 2 sending FSConnector children"),
    (lambda d: d["prefill"].setdefault("env", {}).update(KVCTL_EXTRA_CONNECTORS="garbage"),
     "$.prefill.kv_transfer_config", "invalid kv-transfer-config for the prefill server"),
    (lambda d: (d.update(runtime="docker"), d["prefill"].update(docker_host="tcp://10.0.0.5:2375")),
     "bind, $.prefill.docker_host", "is another host"),
], ids=["missing-model", "blank-prompt", "too-many-children", "spec-config-field", "docker-field"])
def test_plan_refuses_with_the_scenario_field(edit, where, what, kvctl_home, tiny_model):
    doc = shipped("multi-1p1d")
    doc["model"] = str(tiny_model)
    edit(doc)
    with pytest.raises(BadInput) as e:
        plan_scenario(Scenario.model_validate(doc), source="s.yaml")
    assert e.value.where == f"s.yaml: {where}" and what in e.value.what


def test_a_pool_member_that_never_served_fails_the_verify_phase(monkeypatch, tmp_path):
    """Every request passed, but decode-1 served none: the verify phase fails naming it (no servers)."""
    from types import SimpleNamespace

    from kvctl.scenario import runner
    from kvctl.verify.checks import CheckResult
    from kvctl.verify.report import RequestReport, VerifyReport

    def req(p, d):
        return RequestReport(prompt="x", prompt_tokens=3, key="k",
                             checks=[CheckResult(n, True, "ok") for n in CHECKS],
                             prefill_instance=p, decode_instance=d, instances_from="headers")

    verify = VerifyReport("pd", [req("prefill-0", "decode-0"), req("prefill-1", "decode-0")], 8,
                          pools={"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0", "decode-1"]})
    monkeypatch.setattr(runner, "_verify", lambda state, plan, progress: verify)
    report = ScenarioReport(scenario="pd", source=None, cluster="pd", runtime="local", runtime_reason="",
                            expected_checks=list(CHECKS))
    plan = SimpleNamespace(scenario=SimpleNamespace(expectations=SimpleNamespace(require="all"), eval=None,
                                                    second_round=None))
    progress = runner.ScenarioProgress()
    runner._verify_and_inspect(SimpleNamespace(store=str(tmp_path)), plan, report, runner._Phases(report, progress),
                               progress)
    assert report.phases["verify"].status == "failed" and "decode-1 never served" in report.phases["verify"].detail
    assert report.failed_checks() == [] and not report.passed
    cases = scenario_junit(report).getroot().iter("testcase")
    assert [c.get("classname") for c in cases if c.find("failure") is not None] == [
        "kvctl.verify.pd.decode-1", "kvctl.scenario.pd"]


def test_report_exit_codes_and_junit_for_a_failed_launch():
    report = ScenarioReport(scenario="s", source=None, cluster="s", runtime="local", runtime_reason="",
                            expected_checks=list(CHECKS))
    report.phases["launch"] = PhaseResult("launch", "failed", 12.0, "the prefill server exited with code 2")
    report.phases["down"] = PhaseResult("down", "passed", 0.1)
    report.error = RuntimeFailure("the prefill server exited with code 2", details="log tail\x1b[0m")
    assert not report.passed and report.exit_code == 3
    root = scenario_junit(report).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {f"phase {p}" for p in PHASES}
    assert cases["phase launch"].find("failure") is not None
    assert "log tail" in cases["phase launch"].find("failure").text
    assert cases["phase verify"].find("skipped") is not None
    assert root.get("failures") == "1" and root.get("tests") == "4"
    ET.fromstring(ET.tostring(root))  # well-formed (control characters dropped)
    report.error, report.interrupted = None, True
    assert report.exit_code == 130


@pytest.mark.parametrize("engines, engine", [({"prefill": "v1", "decode": "v1"}, "v1"),
                                             ({"prefill": "v0", "decode": "v1"}, "mixed"), (None, None)])
def test_report_json_names_the_engine(engines, engine):
    report = ScenarioReport(scenario="s", source=None, cluster="s", runtime="local", runtime_reason="",
                            expected_checks=list(CHECKS), engines=engines)
    doc = report.to_json()
    assert doc["engine"] == engine and doc["engines"] == engines


def test_plan_engines_reach_the_report(kvctl_home, tiny_model, monkeypatch):
    """run_scenario fills `engines` from the plan's spec (each role's engine)."""
    seen = {}
    monkeypatch.setattr(runner, "_run_phases", lambda plan, report, phases, progress: seen.update(report.to_json()))
    doc = shipped("smoke-1p1d")
    doc.update(model=str(tiny_model), engine="v1")
    runner.run_scenario(Scenario.model_validate(doc))
    assert seen["engine"] == "v1" and seen["engines"] == {"prefill": "v1", "decode": "v1"}


# ---------------------------------------------------------------- e2e (rig)


@e2e
def test_smoke_passes_and_leaves_nothing(kvctl, kvctl_home, rig_python, vllm_slot, tmp_path):
    junit = tmp_path / "smoke.xml"
    r = kvctl("scenario", "run", "smoke-1p1d", "--json", "--junit-xml", str(junit), timeout=RUN_TIMEOUT_S)
    assert r.rc == 0, r
    report = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert report["scenario"] == "smoke-1p1d" and report["passed"] is True and report["exit_code"] == 0
    assert phase_status(report) == {p: "passed" for p in PHASES}
    assert all(p["seconds"] is not None for p in report["phases"])
    checks = checks_of(report)
    assert len(checks) == 4 * len(CHECKS) and all(ok for _, _, ok in checks), checks
    assert report["verify"]["passed"] is True
    store = report["store"]
    assert store["num_entries"] == 4 and store["num_valid"] == 4 and store["temp_files"] == []
    assert {e["key"] for e in store["entries"]} == {r["key"] for r in report["verify"]["requests"]}
    assert report["wall_s"] >= sum(p["seconds"] for p in report["phases"]) - 0.5
    tree = ET.parse(junit).getroot()
    assert tree.get("tests") == str(4 * len(CHECKS) + len(PHASES)) and tree.get("failures") == "0"
    assert "✓ launch passed" in r.stderr and "✓ down passed" in r.stderr
    assert_torn_down(kvctl_home)
    assert not Path(store["root"]).exists()  # the fresh store went with the cluster


@e2e
def test_multi_checks_both_children_and_keep_keeps_store_and_logs(kvctl, kvctl_home, rig_python,
                                                                  vllm_slot):
    r = kvctl("scenario", "run", "multi-1p1d", "--json", "--keep", timeout=RUN_TIMEOUT_S)
    assert r.rc == 0, r
    report = json.loads(r.stdout)
    assert report["passed"] is True, report["phases"]
    for request in report["verify"]["requests"]:
        send = next(c for c in request["checks"] if c["name"] == "kv_send_logged")
        assert send["passed"], send
        assert "sent to connector FSConnector (child 0" in send["evidence"]
        assert "sent to connector FSConnector (child 1" in send["evidence"]
    kept = Path(report["kept"])
    assert kept.parent == kvctl_home / "scenario-runs"
    assert Path(report["store"]["root"]) == kept / "store"
    assert len(list((kept / "store").glob("*.safetensors"))) == 4
    assert "sent to connector FSConnector" in (kept / "logs" / "prefill.log").read_text()
    assert "skip model forwarding" in (kept / "logs" / "decode.log").read_text()
    assert_torn_down(kvctl_home)


@e2e
def test_decode_that_cannot_receive_fails_skip_check_and_tears_down(kvctl, kvctl_home, rig_python,
                                                                     tiny_model, vllm_slot, tmp_path):
    # The schema requires a kv_transfer_config on D, so D is made unable to receive the
    # other way: vLLM's stock CPU worker (the last --worker-cls wins) never creates
    # the connector. Outputs still match; only the skip check can tell.
    doc = shipped("smoke-1p1d")
    doc.update(name="no-receive", model=str(tiny_model), prompts=["Hello, how are you?", "Tell me about the sea."])
    doc["decode"]["args"] = ["--worker-cls=auto"]
    path = write_scenario(tmp_path, doc, "no-receive")
    r = kvctl("scenario", "run", str(path), "--json", timeout=RUN_TIMEOUT_S)
    assert r.rc == 1, r
    report = json.loads(r.stdout)
    assert report["passed"] is False and report["error"] is None
    failed = {(name, ok) for _, name, ok in checks_of(report) if not ok}
    assert failed == {("decode_skipped_forward", False)}, checks_of(report)
    assert phase_status(report) == {"launch": "passed", "verify": "failed", "inspect": "passed",
                                    "down": "passed"}
    assert "decode_skipped_forward" in next(p["detail"] for p in report["phases"] if p["name"] == "verify")
    assert_torn_down(kvctl_home)


@e2e
def test_launch_failure_exits_3_after_teardown(kvctl, kvctl_home, rig_python, tiny_model, vllm_slot,
                                               tmp_path):
    doc = shipped("smoke-1p1d")
    doc.update(name="bad-flag", model=str(tiny_model))
    doc["prefill"]["args"] = ["--no-such-vllm-flag"]
    r = kvctl("scenario", "run", str(write_scenario(tmp_path, doc, "bad-flag")), timeout=RUN_TIMEOUT_S)
    assert r.rc == 3, r
    assert "the prefill server exited with code" in r.stderr
    assert "unrecognized arguments: --no-such-vllm-flag" in r.stderr  # the log tail
    assert "✗ launch failed" in r.stderr and "✓ down passed" in r.stderr
    assert "FAIL bad-flag (exit 3)" in r.stdout
    assert_torn_down(kvctl_home)


@e2e
def test_ctrl_c_during_verify_exits_130_and_tears_down(kvctl, kvctl_home, rig_python, tiny_model,
                                                       vllm_slot, tmp_path):
    doc = shipped("smoke-1p1d")
    doc.update(name="interrupted", model=str(tiny_model), max_tokens=64,
               prompts=[f"Question {i}: tell me about the sea." for i in range(60)])
    proc = kvctl.popen("scenario", "run", str(write_scenario(tmp_path, doc, "interrupted")), "--json")
    try:
        seen = ""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "request 1/60 done" not in seen:  # verify is under way
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, f"no verify progress; stderr so far:\n{seen}"
            seen += line
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, seen + stderr
    report = json.loads(stdout)
    assert report["interrupted"] is True and report["exit_code"] == 130
    assert phase_status(report)["verify"] == "interrupted" and phase_status(report)["down"] == "passed"
    assert_torn_down(kvctl_home)
