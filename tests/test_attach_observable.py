"""Checks whose evidence is out of reach: reported as not observable, never passed, and
`--require` decides the verdict; log commands (`cmd:`) captured while verify runs.

Against test_verify_unit's FakeInstance servers (no vLLM); tests/test_attach_e2e.py
does the same on real servers.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import yaml
from test_attach import _children_running
from test_verify_unit import FS_CONSUMER, FS_PRODUCER, FakeInstance

from kvctl.cli import main
from kvctl.scenario.runner import run_scenario
from kvctl.scenario.schema import Scenario
from kvctl.verify.checks import CHECKS


@pytest.fixture
def servers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    store = tmp_path / "store"
    store.mkdir()
    p = FakeInstance("prefill", store, tmp_path / "p.log")
    d = FakeInstance("decode", store, tmp_path / "d.log")
    yield p, d, store
    p.close()
    d.close()


def _attach(name, p, d, *extra):
    assert main(["attach", name, "--prefill", p.url, "--decode", d.url, "--model-name", "tiny", *extra]) == 0


def _verify(capsys, name, *extra) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["verify", "--name", name, "--prompt", "Hello", "--prompt", "Bye", "--max-tokens", "4", "--json",
               *extra])
    return rc, json.loads(capsys.readouterr().out)


def _statuses(doc) -> dict[str, str]:
    """check name -> passed | failed | not_observable, over every request (the worst seen)."""
    order = {"passed": 0, "not_observable": 1, "failed": 2}
    found: dict[str, str] = {}
    for r in doc["requests"]:
        for c in r["checks"]:
            s = "passed" if c["passed"] else ("not_observable" if c.get("observable") is False else "failed")
            if order[s] >= order.get(found.get(c["name"], "passed"), 0):
                found[c["name"]] = s
    return found


def test_no_logs_no_store_everything_but_the_output_is_not_observable(servers, capsys, tmp_path):
    p, d, _ = servers
    _attach("blind", p, d)
    rc, doc = _verify(capsys, "blind")
    assert rc == 1 and doc["passed"] is False and doc["require"] == "all"  # not observable is no pass
    assert _statuses(doc) == {"kv_send_logged": "not_observable", "store_entry_written": "not_observable",
                              "decode_skipped_forward": "not_observable", "output_matches_baseline": "passed"}
    assert "no log source" in doc["not_observable"]["kv_send_logged"]
    assert "not visible" in doc["not_observable"]["store_entry_written"]
    assert doc["requests"][0]["not_observable"] == list(CHECKS[:3])
    junit = tmp_path / "v.xml"
    rc, doc = _verify(capsys, "blind", "--require", "observable", "--junit-xml", str(junit))
    assert rc == 0 and doc["passed"] is True and doc["require"] == "observable"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("skipped") == "6" and suite.get("failures") == "0"
    assert main(["verify", "--name", "blind", "--prompt", "Hello", "--max-tokens", "2"]) == 1
    out = capsys.readouterr().out
    assert "? kv_send_logged not observable:" in out and "--require observable would allow them" in out
    assert main(["verify", "--name", "blind", "--require", "some"]) == 2
    assert main(["inspect-store", "--name", "blind"]) == 2
    assert "attached without a store path" in capsys.readouterr().err


def test_logs_without_store_verify_every_other_check(servers, capsys):
    p, d, _ = servers
    _attach("nostore", p, d, "--prefill-log", str(p.log), "--decode-log", str(d.log))
    rc, doc = _verify(capsys, "nostore")
    assert _statuses(doc) == {"kv_send_logged": "passed", "store_entry_written": "not_observable",
                              "decode_skipped_forward": "passed", "output_matches_baseline": "passed"}
    assert rc == 1
    rc, doc = _verify(capsys, "nostore", "--require", "observable")
    assert rc == 0 and list(doc["not_observable"]) == ["store_entry_written"]
    assert doc["requests"][0]["transfer_bytes"] == 1024  # from D's skip line


def test_store_without_the_prefill_log_cannot_find_the_key(servers, capsys):
    p, d, store = servers
    _attach("nop", p, d, "--decode-log", str(d.log), "--store", str(store))
    rc, doc = _verify(capsys, "nop", "--require", "observable")
    assert rc == 0
    assert _statuses(doc)["store_entry_written"] == "not_observable"
    assert "found by the key in P's log" in doc["not_observable"]["store_entry_written"]
    assert "comes from P's log" in doc["not_observable"]["decode_skipped_forward"]


def test_log_commands_are_captured_while_verify_runs(servers, capsys, tmp_path):
    p, d, store = servers
    _attach("tailed", p, d, "--prefill-log", f"cmd:tail -n0 -F {p.log}", "--decode-log", f"cmd:tail -n0 -F {d.log}",
            "--store", str(store))
    rc, doc = _verify(capsys, "tailed")
    assert rc == 0 and doc["passed"] and doc["not_observable"] == {}, doc
    assert _children_running(tmp_path) == []  # the tails stopped with verify
    captured = tmp_path / "home" / "clusters" / "tailed" / "logs" / "prefill.log"
    assert "INFO start" not in captured.read_text()  # lines from before verify started never count
    capsys.readouterr()
    assert main(["verify", "--name", "tailed", "--requests", "4", "--concurrency", "2", "--max-tokens", "3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["load"]["not_observable"] == {}


def test_a_broken_log_command_is_not_observable_with_its_error(servers, capsys):
    p, d, store = servers
    _attach("broken", p, d, "--prefill-log", "cmd:echo 'pods \"x\" not found' >&2; exit 1",
            "--decode-log", str(d.log), "--store", str(store))
    capsys.readouterr()
    assert main(["verify", "--name", "broken", "--require", "observable", "--requests", "2", "--max-tokens", "3",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "exited with code 1" in doc["not_observable"]["kv_send_logged"]
    assert 'pods "x" not found' in doc["not_observable"]["kv_send_logged"]
    assert doc["load"]["not_observable"] == {"kv_send_logged": 2, "store_entry_written": 2,
                                             "decode_skipped_forward": 2}
    assert doc["load"]["failed_checks"] == {}


def test_attached_scenario_requires_what_it_says(servers, tmp_path):
    p, d, _ = servers
    f = tmp_path / "attach.yaml"
    f.write_text(yaml.safe_dump({"served_model_name": "tiny",
                                 "prefill": {"url": p.url, "log": str(p.log), "kv_transfer_config": FS_PRODUCER},
                                 "decode": {"url": d.url, "log": str(d.log), "kv_transfer_config": FS_CONSUMER}}))

    def run(require):
        s = Scenario.model_validate({"name": "att", "cluster": {"attach": str(f)}, "prompts": ["Hello"],
                                     "max_tokens": 3, "expectations": {"require": require}})
        return run_scenario(s)

    lenient = run("observable")
    assert lenient.passed, lenient.to_json()
    assert lenient.to_json()["verify"]["not_observable"].keys() == {"store_entry_written"}
    strict = run("all")
    assert not strict.passed and strict.phases["verify"].status == "failed"
    assert "store_entry_written" in strict.phases["verify"].detail


# ---------------------------------------------------------------- through the endpoint (the router)


@pytest.fixture
def routed(tmp_path, monkeypatch):
    """Two fake Ps and two fake Ds on one store, behind a real `python -m kvctl.router`."""
    from kvctl.cluster.router_process import router_instance, start_router
    from kvctl.net import free_ports

    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    store = tmp_path / "store"
    store.mkdir()
    fakes = {f"{role}-{i}": FakeInstance(role, store, tmp_path / f"{role}-{i}.log")
             for role in ("prefill", "decode") for i in range(2)}
    try:
        # kvctl's own router start (it waits, bounded, for /health), as a launch does
        record = start_router({name: (fake.role, fake.url) for name, fake in fakes.items()}, tmp_path / "router",
                              free_ports(1)[0], health_interval_s=0.2)
        try:
            yield record["url"], fakes, store
        finally:
            router_instance(record).stop(10.0)
    finally:
        for fake in fakes.values():
            fake.close()


def _attach_routed(tmp_path, url, fakes, store, *, blind: str | None = None):
    f = tmp_path / "routed.yaml"
    pools = {role: [{"name": n, "url": x.url, "kv_transfer_config": FS_PRODUCER if role == "prefill" else FS_CONSUMER,
                     **({} if n == blind else {"log": str(x.log)})}
                    for n, x in fakes.items() if x.role == role] for role in ("prefill", "decode")}
    f.write_text(yaml.safe_dump({"served_model_name": "tiny", "endpoint": url, "store": str(store), **pools}))
    assert main(["attach", "routed", "--file", str(f)]) == 0


def test_verify_through_the_endpoint_finds_the_evidence_on_any_instance(routed, tmp_path, capsys):
    url, fakes, store = routed
    _attach_routed(tmp_path, url, fakes, store)
    capsys.readouterr()
    assert main(["verify", "--name", "routed", "--via-endpoint", "--prompt", "Hello", "--prompt", "Bye",
                 "--prompt", "Grüße", "--max-tokens", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] and doc["not_observable"] == {}, doc
    used = {n for n, x in fakes.items() if "KV send DONE" in x.log.read_text() or "skip" in x.log.read_text()}
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= used  # round robin reached every instance
    assert main(["verify", "--name", "routed", "--via-endpoint", "--requests", "6", "--concurrency", "3",
                 "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["load"]["failed_checks"] == {}


def test_through_the_endpoint_an_instance_without_a_log_is_not_observable(routed, tmp_path, capsys):
    url, fakes, store = routed
    _attach_routed(tmp_path, url, fakes, store, blind="prefill-1")
    capsys.readouterr()
    assert main(["verify", "--name", "routed", "--via-endpoint", "--prompt", "Hello", "--prompt", "Bye",
                 "--max-tokens", "4", "--json"]) == 1  # require all: what went to prefill-1 is unseen
    doc = json.loads(capsys.readouterr().out)
    statuses = _statuses(doc)
    assert statuses["kv_send_logged"] == "not_observable" and statuses["output_matches_baseline"] == "passed"
    assert "prefill-1: no log source" in doc["not_observable"]["kv_send_logged"]
    assert "failed" not in statuses.values()
    capsys.readouterr()
    assert main(["verify", "--name", "routed", "--via-endpoint", "--prompt", "Hello", "--prompt", "Bye",
                 "--max-tokens", "4", "--require", "observable"]) == 0
    assert main(["verify", "--name", "routed", "--via-endpoint", "--prompt", "x", "--max-tokens", "2"]) in (0, 1)
    assert main(["detach", "routed"]) == 0
    assert main(["attach", "direct", "--prefill", fakes["prefill-0"].url, "--decode", fakes["decode-0"].url,
                 "--model-name", "tiny"]) == 0
    assert main(["verify", "--name", "direct", "--via-endpoint"]) == 2
    assert "has no endpoint" in capsys.readouterr().err
