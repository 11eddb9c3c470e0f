"""Attached clusters without vLLM: state, attach/detach, status, down's refusal, attach files,
log commands captured while verify runs, and scenarios that attach.

The instances are test_verify_unit's FakeInstance servers (they speak /health,
/tokenize and chat, write real store entries and log our connectors' lines);
tests/test_attach_e2e.py attaches to real vLLM servers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import pid_alive
from test_verify_unit import FS_CONSUMER, FS_PRODUCER, FakeInstance

from kvctl.attach.attach import attach_cluster, detach_cluster, spec_from_file, spec_from_options
from kvctl.attach.file import check_attach_file
from kvctl.cli import main
from kvctl.cluster.lifecycle import _ensure_name_free, cluster_status, down
from kvctl.cluster.state import ClusterState, InstanceRecord, LogSource, load_cluster, save_cluster, utc_now
from kvctl.errors import BadInput
from kvctl.runtime.processes import processes_under
from kvctl.scenario.runner import run_scenario
from kvctl.scenario.schema import Scenario, check_scenario
from kvctl.verify.cluster_info import NO_LOG_SOURCE, STORE_NOT_VISIBLE, cluster_info, load_cluster_info
from kvctl.verify.log_files import LogFile, capturing_logs
from kvctl.verify.verifier import verify_cluster


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def servers(tmp_path):
    """A fake P and D sharing a store, each logging to its own file."""
    store = tmp_path / "store"
    store.mkdir()
    p = FakeInstance("prefill", store, tmp_path / "p.log")
    d = FakeInstance("decode", store, tmp_path / "d.log")
    yield p, d, store
    p.close()
    d.close()


def _attach_args(p, d, store=None, *extra):
    args = ["attach", "other", "--prefill", p.url, "--decode", d.url, "--prefill-log", str(p.log),
            "--decode-log", str(d.log), "--model-name", "tiny", *extra]
    return args + (["--store", str(store)] if store else [])


# ---------------------------------------------------------------- state


def test_launched_state_json_is_unchanged_and_attached_adds_fields(home):
    launched = ClusterState(name="l", runtime="local", model="/m", served_model_name="m", store="/s",
                            created=utc_now(), instances={"prefill": InstanceRecord(
                                "prefill", "http://127.0.0.1:1", "/l/p.log", None, "/c", {"pid": 1})})
    doc = launched.to_json()
    assert list(doc) == ["name", "runtime", "model", "served_model_name", "store", "created", "instances"]
    assert list(doc["instances"]["prefill"]) == ["role", "url", "pid", "log_path", "kv_transfer_config", "cwd"]
    assert ClusterState.from_json(doc).to_json() == doc
    attached = ClusterState(name="a", runtime="attached", model="m", served_model_name="m", store=None,
                            created=utc_now(), managed=False, endpoint="http://r:8000", instances={
                                "decode-0": InstanceRecord("decode", "http://d:1", "", None, "", {}, log_source="")})
    doc = attached.to_json()
    assert doc["store"] is None and doc["managed"] is False and doc["endpoint"] == "http://r:8000"
    assert doc["instances"]["decode-0"]["log_source"] is None
    back = ClusterState.from_json(doc)
    assert back.to_json() == doc and back.instances["decode-0"].source() is None and not back.managed
    assert list(back.by_role("decode")) == ["decode-0"]


def test_log_source_forms():
    assert LogSource.parse("cmd: kubectl logs -f x").command == "kubectl logs -f x"
    assert str(LogSource.parse("cmd:tail -F a")) == "cmd:tail -F a"
    assert LogSource.parse("rel.log").path == Path("rel.log").absolute()
    for bad in ("", "cmd:", "cmd:   "):
        with pytest.raises(BadInput):
            LogSource.parse(bad, "decode_log")


# ---------------------------------------------------------------- attach, status, verify, down, detach


def test_attach_status_verify_down_refuses_detach_forgets(home, servers, capsys):
    p, d, store = servers
    assert main([*_attach_args(p, d, store), "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["managed"] is False and state["runtime"] == "attached" and state["store"] == str(store)
    assert state["instances"]["prefill"]["log_source"] == str(p.log) and state["notes"] == []
    assert main(["status", "--name", "other", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["healthy"] is True and status["instances"]["decode"]["detail"] == "attached: /health answers"

    assert main(["verify", "--name", "other", "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and [c["passed"] for c in report["requests"][0]["checks"]] == [True] * 4

    assert main(["down", "--name", "other"]) == 2
    err = capsys.readouterr().err
    assert "was attached, not started by kvctl" in err and "kvctl detach other" in err
    assert load_cluster("other").instances["prefill"].url == p.url  # nothing removed
    with pytest.raises(BadInput) as e:  # a launch under its name says what holds it (and starts nothing)
        _ensure_name_free("other")
    assert "was attached" in e.value.what
    assert main(["detach", "other", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["found"] is True
    assert not (home / "clusters" / "other").exists()
    assert main(["detach", "other"]) == 0  # idempotent
    assert "nothing to forget" in capsys.readouterr().err
    with httpx_client() as c:  # the servers kept running
        assert c.get(f"{p.url}/health").status_code == 200


def httpx_client():
    import httpx

    return httpx.Client(timeout=5)


def test_detach_refuses_a_launched_cluster_and_attach_refuses_a_taken_name(home, servers):
    p, d, _ = servers
    save_cluster(ClusterState(name="mine", runtime="local", model="/m", served_model_name="m", store="/s",
                              created=utc_now(), instances={}))
    with pytest.raises(BadInput) as e:
        detach_cluster("mine")
    assert "launched by kvctl" in e.value.what and "kvctl down" in e.value.fix
    with pytest.raises(BadInput) as e:
        attach_cluster(spec_from_options("mine", prefill=p.url, decode=d.url, model_name="tiny"))
    assert "already exists (launched by kvctl)" in e.value.what


def test_status_of_an_attached_cluster_that_went_away(home, servers):
    p, d, _ = servers
    attach_cluster(spec_from_options("gone", prefill=p.url, decode="http://127.0.0.1:9", model_name="tiny"))
    st = cluster_status("gone")
    assert not st.healthy and st.instances["prefill"].healthy
    assert st.instances["decode"].detail == "attached: /health does not answer"
    with pytest.raises(BadInput):
        down("gone")


@pytest.mark.parametrize("kwargs,field", [
    ({"prefill": "localhost:8000"}, "prefill"),
    ({"decode": "ftp://x"}, "decode"),
    ({"prefill_log": "/nonexistent/p.log"}, "prefill_log"),
    ({"decode_log": "cmd:"}, "decode_log"),
    ({"store": Path("/nonexistent/store")}, "store"),
    ({"model_name": None, "prefill": "http://127.0.0.1:9"}, "model_name"),  # nobody answers /v1/models
])
def test_bad_attach_input_names_the_field(kwargs, field, home, servers):
    p, d, _ = servers
    args = {"prefill": p.url, "decode": d.url, "model_name": "tiny", **kwargs}
    with pytest.raises(BadInput) as e:
        attach_cluster(spec_from_options("bad", **args))
    assert e.value.fields == (field,), e.value.message
    assert not (home / "clusters" / "bad").exists()


def test_served_model_name_is_asked_when_not_given(home, tmp_path):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Models(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            raw = json.dumps({"data": [{"id": "served", "root": "/models/tiny"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        result = attach_cluster(spec_from_options("asked", prefill=url, decode=url))
    finally:
        srv.shutdown()
        srv.server_close()
    assert result.state.served_model_name == "served" and result.state.model == "/models/tiny"
    assert len(result.notes) == 3  # no P log, no D log, no store: each will be not observable


# ---------------------------------------------------------------- attach files


POOLS = {
    "served_model_name": "tiny",
    "endpoint": "http://127.0.0.1:18000/",
    "store": "store",
    "prefill": [{"url": "http://10.0.0.5:8000", "log": "logs/p0.log", "kv_transfer_config": FS_PRODUCER},
                {"name": "p-b", "url": "http://10.0.0.6:8000", "log": "cmd:kubectl logs -f --tail=0 pod/p-b"}],
    "decode": {"url": "http://10.0.0.7:8000/"},
}


def test_attach_file_pools_relative_paths_and_names(home, tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "p0.log").write_text("")
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump(POOLS))
    spec = spec_from_file(f, "pools")
    assert [(i.name, i.role) for i in spec.instances] == [("prefill-0", "prefill"), ("p-b", "prefill"),
                                                          ("decode", "decode")]
    assert spec.instances[0].log.path == tmp_path / "logs" / "p0.log"
    assert spec.instances[2].url == "http://10.0.0.7:8000" and spec.instances[2].log is None
    assert spec.store == tmp_path / "store" and spec.endpoint == "http://127.0.0.1:18000"
    result = attach_cluster(spec)
    state = load_cluster("pools")
    assert state.instances["p-b"].log_path == str(home / "clusters" / "pools" / "logs" / "p-b.log")
    assert any("decode: no log source" in n for n in result.notes)
    info = load_cluster_info("pools")
    assert info.prefill.name == "prefill-0" and info.decode.name == "decode"
    assert info.decode.log_path is None and info.decode.unobservable == NO_LOG_SOURCE
    assert load_cluster_info("pools", prefill="p-b").prefill.log_command == "kubectl logs -f --tail=0 pod/p-b"
    with pytest.raises(BadInput) as e:
        load_cluster_info("pools", decode="decode-7")
    assert e.value.fields == ("decode",) and "use one of: decode" in e.value.fix


def test_attach_file_problems_have_json_paths(tmp_path):
    bad = {"prefill": [{"url": "nope", "log": 3}, "x"], "decode": [{"name": "prefill-0", "url": "http://a:1",
                                                                     "color": "red"}], "stroe": "/s"}
    parsed, problems = check_attach_file(bad)
    assert parsed is None
    paths = {p.path for p in problems}
    assert paths == {"$.stroe", "$.prefill[0].log", "$.prefill[1]", "$.decode[0].color"}, paths
    assert any("did you mean 'store'" in p.fix for p in problems)
    _, problems = check_attach_file({"prefill": [{"url": "nope"}], "decode": [{"name": "prefill-0", "url": "http://a:1"}]})
    assert [p.path for p in problems] == ["$.prefill[0].url", "$"]
    assert "instance name 'prefill-0' is used 2 times" in problems[1].message
    assert check_attach_file({"prefill": {"url": "http://a:1"}})[1][0].path == "$.decode"
    f = tmp_path / "a.yaml"
    f.write_text(yaml.safe_dump(bad))
    with pytest.raises(BadInput) as e:
        spec_from_file(f, "x")
    assert "problems" in e.value.what and "$.stroe" in e.value.details


def test_cli_attach_refuses_mixed_and_missing_options(home, capsys, tmp_path):
    assert main(["attach", "x", "--file", str(tmp_path / "f.yaml"), "--prefill", "http://a:1"]) == 2
    assert "--prefill given with an attach file" in capsys.readouterr().err
    assert main(["attach", "x", "--decode", "http://a:1"]) == 2
    assert "missing --prefill" in capsys.readouterr().err
    assert main(["attach", "Bad Name", "--prefill", "http://a:1", "--decode", "http://a:2"]) == 2
    assert "where: NAME" in capsys.readouterr().err


# ---------------------------------------------------------------- cluster_info


def test_cluster_info_of_an_attached_cluster_without_logs_or_store():
    state = {"name": "a", "runtime": "attached", "managed": False, "model": "m", "served_model_name": "m",
             "created": "x", "instances": {
                 "decode-0": {"role": "decode", "url": "http://d:1", "log_path": "", "log_source": None},
                 "prefill-0": {"role": "prefill", "url": "http://p:1", "log_path": "/c/logs/prefill-0.log",
                               "log_source": "cmd:journalctl -fu vllm-prefill"}}}
    info = cluster_info(state)
    assert info.store is None and info.store_unobservable == STORE_NOT_VISIBLE
    assert info.prefill.log_command == "journalctl -fu vllm-prefill"
    assert info.prefill.log_path == Path("/c/logs/prefill-0.log")
    assert info.decode.log_path is None and LogFile(info.decode.log_path).read_from(0) == ""
    assert [i.name for i in info.all_instances()] == ["decode-0", "prefill-0"]  # as listed


# ---------------------------------------------------------------- log commands


def _info_with_commands(tmp_path, p_cmd: str, d_cmd: str):
    state = {"name": "c", "runtime": "attached", "managed": False, "model": "m", "served_model_name": "m",
             "created": "x", "store": str(tmp_path), "instances": {
                 "prefill": {"role": "prefill", "url": "http://p:1", "log_path": str(tmp_path / "cap-p.log"),
                             "log_source": f"cmd:{p_cmd}"},
                 "decode": {"role": "decode", "url": "http://d:1", "log_path": str(tmp_path / "cap-d.log"),
                            "log_source": f"cmd:{d_cmd}"}}}
    return cluster_info(state)


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_capture_streams_new_lines_only_and_stops_its_command(tmp_path):
    src = tmp_path / "server.log"
    src.write_text("old line 1\nold line 2\n")
    info = _info_with_commands(tmp_path, f"tail -n0 -F {src}", f"echo backlog; sleep 0.2; echo more; tail -n0 -F {src}")
    with capturing_logs(info) as seen:
        assert seen.prefill.log_path is not None and seen.prefill.unobservable == ""
        p_log, d_log = LogFile(seen.prefill.log_path), LogFile(seen.decode.log_path)
        start = p_log.offset(), d_log.offset()
        assert "backlog\nmore\n" == d_log.read_from(0)  # written before the block starts
        with open(src, "a") as f:
            f.write("INFO KV send DONE. key=abc\n")
        assert _wait_for(lambda: "key=abc" in p_log.read_from(start[0]) and "key=abc" in d_log.read_from(start[1]))
        assert "old line" not in p_log.read_from(0)
        pids = [c for c in _children_running(tmp_path)]
        assert pids, "the capture commands run while the block runs"
    assert _wait_for(lambda: not [pid for pid in pids if pid_alive(pid)], 5), "capture commands left running"


def _children_running(tmp_path) -> list[int]:
    return [pid for pid, cmd in processes_under(tmp_path)
            if "tail" in cmd and pid != os.getpid()]


def test_a_failing_command_makes_that_log_not_observable(tmp_path):
    info = _info_with_commands(tmp_path, "echo 'error: no such pod' >&2; exit 3", "tail -n0 -F /dev/null")
    with capturing_logs(info) as seen:
        assert seen.prefill.log_path is None
        assert "exited with code 3" in seen.prefill.unobservable and "no such pod" in seen.prefill.unobservable
        assert seen.decode.log_path is not None


def test_ctrl_c_and_sigterm_stop_the_commands(tmp_path):
    info = _info_with_commands(tmp_path, f"tail -n0 -F {tmp_path}/x.log", f"tail -n0 -F {tmp_path}/y.log")
    for how in ("KeyboardInterrupt", "SIGTERM"):
        with pytest.raises(KeyboardInterrupt):
            with capturing_logs(info):
                pids = _children_running(tmp_path)
                assert len(pids) >= 2
                if how == "SIGTERM":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1)
                raise KeyboardInterrupt
        assert _wait_for(lambda: not [pid for pid in pids if pid_alive(pid)], 5), how


def test_a_cluster_without_commands_is_yielded_as_it_is(tmp_path, servers):
    p, d, store = servers
    info = cluster_info({"name": "c", "runtime": "local", "model": "m", "served_model_name": "tiny",
                         "store": str(store), "instances": {
                             "prefill": {"role": "prefill", "url": p.url, "log_path": str(p.log),
                                         "kv_transfer_config": FS_PRODUCER},
                             "decode": {"role": "decode", "url": d.url, "log_path": str(d.log),
                                        "kv_transfer_config": FS_CONSUMER}}})
    with capturing_logs(info) as seen:
        assert seen is info
    assert verify_cluster(info, ["Hello"], 3).passed


# ---------------------------------------------------------------- scenarios that attach


def _attach_scenario(tmp_path, attach_file: Path, **expectations) -> Scenario:
    doc = {"name": "attached-smoke", "cluster": {"attach": attach_file.name}, "prompts": ["Hello", "Bye"],
           "max_tokens": 4, "expectations": expectations}
    assert [p for p in check_scenario(doc) if p.severity == "error"] == []
    return Scenario.model_validate(doc)


def test_attach_scenario_schema():
    assert [p.path for p in check_scenario({"name": "x", "prompts": ["a"]})] == ["$.prefill", "$.decode"]
    problems = check_scenario({"name": "x", "cluster": {"attach": "f.yaml"}, "runtime": "docker", "prompts": ["a"],
                               "prefill": {"kv_transfer_config": FS_PRODUCER}})
    assert [(p.path, p.severity) for p in problems] == [("$.prefill", "error"), ("$.runtime", "warning")]
    typo = check_scenario({"name": "x", "cluster": {"atach": "f"}, "prompts": ["a"]})
    assert ("$.cluster.atach", "did you mean 'attach'?") in [(p.path, p.fix) for p in typo]


def test_scenario_attaches_verifies_inspects_and_detaches(home, servers, tmp_path):
    p, d, store = servers
    f = tmp_path / "attach.yaml"
    f.write_text(yaml.safe_dump({"served_model_name": "tiny", "store": str(store),
                                 "prefill": {"url": p.url, "log": str(p.log), "kv_transfer_config": FS_PRODUCER},
                                 "decode": {"url": d.url, "log": str(d.log), "kv_transfer_config": FS_CONSUMER}}))
    report = run_scenario(_attach_scenario(tmp_path, f), source=str(tmp_path / "scenario.yaml"))
    doc = report.to_json()
    assert report.passed, doc
    assert doc["runtime"] == "attached" and doc["cluster"] == "attached-smoke"
    phases = {ph["name"]: ph for ph in doc["phases"]}
    assert phases["launch"]["detail"].startswith("attached, not started by kvctl")
    assert phases["down"]["detail"] == "detached; its servers keep running"
    assert doc["store"]["entries"] and not (home / "clusters" / "attached-smoke").exists()


def test_scenario_without_a_visible_store_reports_inspect_not_observable(home, servers, tmp_path):
    p, d, _ = servers
    f = tmp_path / "attach.yaml"
    f.write_text(yaml.safe_dump({"served_model_name": "tiny", "prefill": {"url": p.url}, "decode": {"url": d.url}}))
    report = run_scenario(_attach_scenario(tmp_path, f, checks=["output_matches_baseline"], require="observable"),
                          source=str(tmp_path / "scenario.yaml"))
    phases = {ph.name: ph for ph in report.phases.values()}
    assert phases["inspect"].status == "passed" and phases["inspect"].detail.startswith("not observable")
    assert report.passed, report.to_json()
    strict = run_scenario(_attach_scenario(tmp_path, f, checks=["output_matches_baseline"]),
                          source=str(tmp_path / "scenario.yaml"))
    assert strict.phases["inspect"].status == "failed" and not strict.passed
    assert not (home / "clusters" / "attached-smoke").exists()


def test_an_attached_cluster_is_never_killed_or_stopped(kvctl_home):
    """The attached runtime starts nothing, so the fault bench and an instance's kill/stop refuse it."""
    from kvctl.bench.faults import measure_fault
    from kvctl.cluster.lifecycle import instance

    records = {n: InstanceRecord(n.rpartition("-")[0], "http://127.0.0.1:9", "", None, "", {}, "")
               for n in ("prefill-0", "prefill-1", "decode-0")}
    save_cluster(ClusterState(name="att", runtime="attached", model="m", served_model_name="m", store=None,
                              created=utc_now(), managed=False, endpoint="http://127.0.0.1:9", instances=records))
    with pytest.raises(BadInput) as e:
        measure_fault("att", "prefill-1")
    assert e.value.fields == ("kill",) and "not a server kvctl started" in e.value.what
    inst = instance("att", "prefill-1")
    assert (inst.name, inst.role) == ("prefill-1", "prefill")
    for act in (inst.kill, inst.stop):
        with pytest.raises(BadInput, match="was not started by kvctl"):
            act()


def test_attach_file_checks_a_v1_only_config_for_v1(tmp_path):
    """A NIXL cluster's configs (V1-only connectors) are valid in an attach file; a typo is still caught."""
    from kvctl.cluster import nixl

    doc = {"served_model_name": "tiny",
           "prefill": {"url": "http://10.0.0.5:8000", "kv_transfer_config": nixl.default_config("prefill", 2)},
           "decode": {"url": "http://10.0.0.6:8000", "kv_transfer_config": nixl.default_config("decode", 2)}}
    f = tmp_path / "nixl.yaml"
    f.write_text(yaml.safe_dump(doc))
    spec = spec_from_file(f, "nx")
    assert [i.kv_transfer_config["kv_connector"] for i in spec.instances] == ["NixlConnector", "NixlConnector"]
    doc["decode"]["kv_transfer_config"]["kv_role"] = "kv_consumr"
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(BadInput) as e:
        spec_from_file(f, "nx")
    assert "$.decode.kv_transfer_config.kv_role" in str(e.value.to_json())
