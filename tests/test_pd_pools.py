"""xPyD pools without servers: `kvctl launch pd --prefill N --decode M` as a spec.

- Instances are prefill-0.., decode-0.. (1P1D keeps `prefill` and `decode`),
  each with its role's config, so all of them share the one store.
- Each gets its own port, log and core (round robin over the available cores;
  1P1D still binds P to the first core and D to the second).
- Bad pool sizes are refused before anything starts, naming the flag (pools
  on the docker runtime: tests/test_docker_pools.py).
- `kvctl logs` takes an instance name; a role names its only instance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvctl.cluster import lifecycle
from kvctl.cluster import spec as spec_mod
from kvctl.cluster.lifecycle import instance_specs
from kvctl.cluster.spec import build_1p1d_spec, build_pd_spec, spread_cpu_binds
from kvctl.cluster.state import ClusterState, InstanceRecord, save_cluster, utc_now
from kvctl.errors import BadInput
from kvctl.net import free_ports
from kvctl.runtime.base import StopResult


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(spec_mod, "available_cores", lambda: [0, 1, 2, 3])


def test_pools_are_named_by_role_and_index_and_share_one_store(kvctl_home, model_dir, four_cores):
    spec = build_pd_spec(prefill=2, decode=3, name="pools", model=model_dir)
    planned = spec.instances()
    assert [(p.name, p.role) for p in planned] == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"),
        ("decode-0", "decode"), ("decode-1", "decode"), ("decode-2", "decode")]
    specs = instance_specs(spec)
    assert list(specs) == [p.name for p in planned]
    stores = {s.kv_transfer_config["kv_connector_extra_config"]["fs_storage_path"] for s in specs.values()}
    assert stores == {str(spec.store)}
    assert {s.kv_transfer_config["kv_role"] for n, s in specs.items() if n.startswith("prefill")} == {"kv_producer"}
    assert {s.kv_transfer_config["kv_role"] for n, s in specs.items() if n.startswith("decode")} == {"kv_consumer"}
    assert len({s.port for s in specs.values()}) == 5 and all(s.port for s in specs.values())
    assert [s.log_path.name for s in specs.values()] == [f"{p.name}.log" for p in planned]
    # one core each, round robin: the fifth server shares the first core
    assert [s.cpu_bind for s in specs.values()] == ["0", "1", "2", "3", "0"]


def test_1p1d_keeps_its_names_and_binds(kvctl_home, model_dir, four_cores):
    spec = build_1p1d_spec(name="one", model=model_dir)
    assert [(p.name, p.role, p.cpu_bind) for p in spec.instances()] == [
        ("prefill", "prefill", "0"), ("decode", "decode", "1")]
    assert spec.prefill.cpu_bind == "0" and spec.decode.cpu_bind == "1"
    pd = build_pd_spec(prefill=1, decode=1, name="one", model=model_dir)
    assert [p.name for p in pd.instances()] == ["prefill-0", "decode-0"]


def test_cpu_binds_spread_round_robin():
    assert spread_cpu_binds(4, [0, 1]) == ["0", "1", "0", "1"]
    assert spread_cpu_binds(3, [2, 5, 7, 9]) == ["2", "5", "7"]
    assert spread_cpu_binds(1, [3]) == ["3"]


def test_role_settings_reach_every_instance_of_the_pool(kvctl_home, model_dir):
    spec = build_pd_spec(prefill=2, decode=2, name="opts", model=model_dir,
                         prefill_args=("--seed", "7"), decode_env={"A": "1"}, decode_engine="v1")
    specs = instance_specs(spec)
    assert specs["prefill-0"].extra_args == specs["prefill-1"].extra_args == ("--seed", "7")
    assert specs["decode-0"].env == specs["decode-1"].env == {"A": "1"}
    assert {specs["decode-0"].engine, specs["decode-1"].engine} == {"v1"}
    assert {specs["prefill-0"].engine, specs["prefill-1"].engine} == {"v0"}


def test_given_ports_are_the_first_of_consecutive_ones(kvctl_home, model_dir):
    free = free_ports(1)[0]
    base = 20000 + free % 20000  # a region unlikely to be in use; each port is checked free
    spec = build_pd_spec(prefill=2, decode=2, name="ports", model=model_dir,
                         prefill_port=base, decode_port=base + 10)
    assert [p.port for p in spec.instances()] == [base, base + 1, base + 10, base + 11]
    with pytest.raises(BadInput) as e:
        build_pd_spec(prefill=2, decode=1, name="ports", model=model_dir,
                      prefill_port=base, decode_port=base + 1)
    assert e.value.fields == ("prefill_port", "decode_port")


@pytest.mark.parametrize("sizes, field", [((0, 1), "prefill"), ((1, 0), "decode"), ((1, 65), "decode")])
def test_bad_pool_sizes_are_refused_naming_the_field(kvctl_home, model_dir, sizes, field):
    with pytest.raises(BadInput) as e:
        build_pd_spec(prefill=sizes[0], decode=sizes[1], name="bad", model=model_dir)
    assert e.value.fields == (field,)


def test_launch_pd_needs_both_pool_sizes(kvctl, model_dir):
    r = kvctl("launch", "pd", "--prefill", "2", "--model", str(model_dir))
    assert r.rc == 2 and "--decode" in r.stderr, r


def _fake_cluster(name: str, names: list[str], router: bool = True) -> ClusterState:
    state = ClusterState(name=name, runtime="local", model="/m", served_model_name="m", store="/s",
                         created=utc_now())
    for i, n in enumerate(names):
        state.instances[n] = InstanceRecord(
            role=n.split("-")[0], url=f"http://127.0.0.1:{9 + i}", log_path=f"/logs/{n}.log",
            kv_transfer_config=None, cwd="/", runtime_fields={"pid": 999_999_990 + i})
    if router:
        state.router = {"url": "http://127.0.0.1:8", "pid": 999_999_999, "start_ticks": None,
                        "command": ["router"], "log_path": "/logs/router.log"}
        state.endpoint = state.router["url"]
    save_cluster(state)
    return state


def test_logs_takes_an_instance_name_and_a_role_names_its_only_instance(kvctl_home):
    _fake_cluster("pl", ["prefill-0", "prefill-1", "decode-0"])
    assert lifecycle.instance("pl", "prefill-1").log_path == Path("/logs/prefill-1.log")
    assert lifecycle.instance("pl", "decode").log_path == Path("/logs/decode-0.log")  # the only decode
    assert lifecycle.instance("pl", "router").log_path == Path("/logs/router.log")
    with pytest.raises(BadInput) as e:
        lifecycle.instance("pl", "prefill")
    assert "2 prefill instances" in e.value.what and "prefill-0, prefill-1, decode-0, router" in e.value.fix
    with pytest.raises(BadInput) as e:
        lifecycle.instance("pl", "decode-7")
    assert "no 'decode-7' instance" in e.value.what


def test_status_json_lists_each_pool_instance_with_role_and_url(kvctl, kvctl_home):
    _fake_cluster("st", ["prefill-0", "prefill-1", "decode-0", "decode-1"], router=False)
    r = kvctl("status", "--name", "st", "--json")
    assert r.rc == 1, r  # nothing runs
    insts = json.loads(r.stdout)["instances"]
    assert {n: i["role"] for n, i in insts.items()} == {
        "prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert all(i["url"].startswith("http://127.0.0.1:") and i["running"] is False for i in insts.values())


def test_down_json_names_each_stopped_instance_and_its_role():
    report = lifecycle.DownReport("c", True, [StopResult("prefill-1", True, "SIGTERM", 0.2), StopResult("router", True, None, 0.1)],
                        roles={"prefill-1": "prefill", "router": "router"})
    stopped = report.to_json()["stopped"]
    assert [(s["instance"], s["role"]) for s in stopped] == [("prefill-1", "prefill"), ("router", "router")]


def test_down_for_people_names_each_stopped_instance():
    from io import StringIO

    from rich.console import Console

    from kvctl.views.cluster import render_down
    from kvctl.views.output import Output

    report = lifecycle.DownReport("c", True, [StopResult("prefill-1", True, "SIGTERM", 0.2),
                                              StopResult("router", False, None, 0.0)],
                                  removed="/x/c", roles={"prefill-1": "prefill", "router": "router"})
    err = StringIO()
    render_down(Output(stdout=Console(file=StringIO()), stderr=Console(file=err, width=200)), report)
    assert "prefill-1: stopped (SIGTERM, 0.2 s)" in err.getvalue() and "router: was not running" in err.getvalue()
