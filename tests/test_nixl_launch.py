"""`launch --transfer nixl`: the configs, side-channel ports, UCX transports, lease and
logging each NIXL instance gets (kvctl.cluster.nixl), checked on the spec and the
instance specs a launch would start. Nothing is started here."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvctl.cluster import nixl
from kvctl.cluster.lifecycle import instance_specs
from kvctl.cluster.spec import available_cores, build_1p1d_spec, build_pd_spec
from kvctl.errors import BadInput

V1 = {"prefill_engine": "v1", "decode_engine": "v1"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))


def test_nixl_configs_roles_lease_and_what_each_instance_gets(model_dir):
    spec = build_1p1d_spec(name="n", model=model_dir, transfer="nixl", **V1)
    lease = nixl.lease_duration_s(len(available_cores()))
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        cfg = spec.role(role).kv_transfer_config
        assert cfg == {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"kv_lease_duration": lease}}
    assert spec.side_channel_ports == {"prefill": 0, "decode": 0}
    specs = instance_specs(spec)
    ports = {n: int(s.env[nixl.SIDE_CHANNEL_PORT_ENV]) for n, s in specs.items()}
    http = {s.port for s in specs.values()}
    assert len(set(ports.values()) | http) == 4  # every port distinct
    for s in specs.values():
        assert s.env[nixl.SIDE_CHANNEL_HOST_ENV] == "127.0.0.1"
        assert s.env["UCX_TLS"] == "tcp,cma"
        logging_file = Path(s.env[nixl.LOGGING_CONFIG_ENV])
    conf = json.loads(logging_file.read_text())
    assert conf["loggers"]["vllm"]["level"] == "INFO"
    assert {n for n, c in conf["loggers"].items() if c["level"] == "DEBUG"} == set(nixl.DEBUG_LOGGERS)
    assert conf["handlers"]["vllm"]["level"] == "DEBUG"


def test_the_lease_grows_as_cores_shrink():
    assert nixl.lease_duration_s(2) == 120
    assert nixl.lease_duration_s(1) == 240
    assert nixl.lease_duration_s(8) == nixl.lease_duration_s(64) == nixl.VLLM_LEASE_S
    assert nixl.default_config("decode", 2, device="cuda")["kv_connector_extra_config"] == {
        "kv_lease_duration": nixl.VLLM_LEASE_S}


def test_a_given_side_channel_port_is_the_first_of_a_pools_ports(model_dir):
    base = _free_run(4)
    spec = build_pd_spec(prefill=2, decode=2, name="p", model=model_dir, transfer="nixl",
                         prefill_env={nixl.SIDE_CHANNEL_PORT_ENV: str(base)},
                         decode_env={nixl.SIDE_CHANNEL_PORT_ENV: str(base + 2)}, **V1)
    assert spec.side_channel_ports == {"prefill-0": base, "prefill-1": base + 1,
                                       "decode-0": base + 2, "decode-1": base + 3}
    specs = instance_specs(spec)
    assert [specs[n].env[nixl.SIDE_CHANNEL_PORT_ENV] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")] \
        == [str(base + i) for i in range(4)]


def test_a_taken_side_channel_port_names_the_instance_and_the_port(model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(BadInput) as e:
            build_pd_spec(prefill=2, decode=1, name="t", model=model_dir, transfer="nixl",
                          prefill_env={nixl.SIDE_CHANNEL_PORT_ENV: str(port - 1)}, **V1)
    assert f"side-channel port {port} of prefill-1 is not available" in e.value.what
    assert e.value.fields == ("prefill_env",)
    with pytest.raises(BadInput, match="is not a port"):
        build_1p1d_spec(name="t", model=model_dir, transfer="nixl",
                        decode_env={nixl.SIDE_CHANNEL_PORT_ENV: "http"}, **V1)


def test_a_given_nixl_config_gets_the_same_and_fs_clusters_nothing(model_dir):
    nixl_child = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [nixl_child, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": "local"}}]}}
    spec = build_1p1d_spec(name="m", model=model_dir, prefill_config=multi, decode_config=multi, **V1)
    assert set(spec.side_channel_ports) == {"prefill", "decode"}
    assert all(s.env["UCX_TLS"] == "tcp,cma" for s in instance_specs(spec).values())
    fs = build_1p1d_spec(name="f", model=model_dir, **V1)
    assert fs.side_channel_ports == {}
    assert all(nixl.SIDE_CHANNEL_PORT_ENV not in s.env and "UCX_TLS" not in s.env
               for s in instance_specs(fs).values())
    with pytest.raises(BadInput) as e:
        build_1p1d_spec(name="v0", model=model_dir, transfer="nixl")
    assert e.value.fields == ("transfer",) and "V1 only" in e.value.what


def _free_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports."""
    for start in range(40000, 60000, n + 1):
        socks = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_docker_runs_nixl_instances_on_the_host_network_and_fs_ones_on_published_ports(model_dir):
    pytest.importorskip("docker")
    from kvctl.runtime.docker import DockerRuntime

    for transfer, nixl_net in (("nixl", True), ("fs", False)):
        spec = build_1p1d_spec(name=f"d{transfer}", model=model_dir, transfer=transfer, runtime="docker", **V1)
        runtime = DockerRuntime.for_cluster(spec)
        for ispec in instance_specs(spec).values():
            config = runtime.container_config(ispec, "img:1", {"kvctl.python": "python3"})
            if nixl_net:
                assert config["network_mode"] == "host" and "ports" not in config
                assert config["environment"][nixl.SIDE_CHANNEL_PORT_ENV] == ispec.env[nixl.SIDE_CHANNEL_PORT_ENV]
            else:
                assert "network_mode" not in config and config["ports"] == {f"{ispec.port}/tcp": ("127.0.0.1", ispec.port)}


def test_render_k8s_gives_nixl_pods_their_side_channel_and_the_router_the_handshake(tmp_path):
    from kvctl.k8s.render import K8sSpec, render_k8s

    docs = render_k8s(K8sSpec(name="nx", scenario="v1-nixl-1p1d", model="org/m")).documents()
    pods = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "nx-router"]
    for pod in pods:
        container = pod["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env[nixl.SIDE_CHANNEL_HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env[nixl.SIDE_CHANNEL_PORT_ENV]["value"] == str(nixl.POD_SIDE_CHANNEL_PORT)
        assert env["UCX_TLS"]["value"] == "tcp,cma"
        assert {"name": "nixl", "containerPort": nixl.POD_SIDE_CHANNEL_PORT, "protocol": "TCP"} in container["ports"]
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nx-router")
    assert "--kv-transfer-params" in router["spec"]["template"]["spec"]["containers"][0]["args"]
    fs = render_k8s(K8sSpec(name="fs", scenario="smoke-1p1d", model="org/m")).documents()
    fs_router = next(d for d in fs if d["kind"] == "Deployment" and d["metadata"]["name"] == "fs-router")
    assert "--kv-transfer-params" not in fs_router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert all(nixl.SIDE_CHANNEL_PORT_ENV not in json.dumps(d) for d in fs)
