"""The LMCache servers of a cluster, without servers: planning their ports and configs, their
command line, the options' checks, cluster.json, and verify's offload evidence from log text."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from connectors import log_lines as ll
from kvctl.cluster.lmcache import (MQ_TIMEOUT_S, LMCacheOptions, check_lmcache_options, point_at_server,
                                   server_args, uses_lmcache_server)
from kvctl.cluster.lmcache_process import plan_servers
from kvctl.cluster.state import ClusterState
from kvctl.errors import BadInput
from kvctl.router.config import PREFILL_TIMEOUT_S
from kvctl.verify.checks import OFFLOAD_CHECK, check_offload_logged
from kvctl.verify.cluster_info import cluster_info
from kvctl.verify.markers import lmcache_lines

FS = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"fs_storage_path": "/s", "transfer": True}}


def _p(extra: dict | None = None) -> dict:
    mp = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    if extra is not None:
        mp["kv_connector_extra_config"] = extra
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [FS, mp]}}


D = {"kv_connector": "FSConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"fs_storage_path": "/s"}}


def _free(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_per_instance_servers_one_per_user_with_their_own_ports():
    configs = {"prefill-0": _p(), "prefill-1": _p(), "decode-0": D}
    servers = plan_servers(configs, LMCacheOptions(), iter(_free(4)))
    assert [(s.name, s.serves) for s in servers] == [("lmcache-prefill-0", ("prefill-0",)),
                                                      ("lmcache-prefill-1", ("prefill-1",))]
    ports = [p for s in servers for p in (s.port, s.http_port)]
    assert len(set(ports)) == 4
    assert not uses_lmcache_server(D)


def test_shared_server_serves_every_user():
    configs = {"prefill-0": _p(), "prefill-1": _p(), "decode-0": D}
    servers = plan_servers(configs, LMCacheOptions(sharing="shared"), iter(_free(2)))
    assert [(s.name, s.serves) for s in servers] == [("lmcache", ("prefill-0", "prefill-1"))]


def test_a_given_port_is_kept_and_checked_free():
    port = _free(1)[0]
    [server] = plan_servers({"prefill": _p({"lmcache.mp.port": port})}, LMCacheOptions(), iter(_free(1)))
    assert server.port == port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(BadInput) as e:
            plan_servers({"prefill": _p({"lmcache.mp.port": busy})}, LMCacheOptions(), iter(_free(1)))
    assert e.value.fields[0] == "lmcache_port" and str(busy) in e.value.what


def test_two_per_instance_servers_cannot_share_a_given_port():
    port = _free(1)[0]
    configs = {"prefill-0": _p({"lmcache.mp.port": port}), "prefill-1": _p({"lmcache.mp.port": port})}
    with pytest.raises(BadInput) as e:
        plan_servers(configs, LMCacheOptions(), iter(_free(3)))
    assert e.value.fields[0] == "lmcache_port" and "shared" in (e.value.fix or "")


def test_point_at_server_rewrites_only_the_mp_children():
    cfg = _p({"lmcache.mp.mq_timeout": 30})
    out = point_at_server(cfg, 5678)
    extra = out["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.mq_timeout": 30, "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5678}
    assert out["kv_connector_extra_config"]["connectors"][0] == FS
    assert "lmcache.mp.port" not in str(cfg)  # the input is not changed


def test_point_at_server_bounds_each_blocking_request_to_the_server():
    # LMCache's own 300 s would let a server killed between two heartbeats hang P's store
    # past the router's prefill timeout (twice: PREPARE_STORE, then COMMIT_STORE).
    out = point_at_server(_p(), 5678)
    extra = out["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert extra["lmcache.mp.mq_timeout"] == MQ_TIMEOUT_S and 2 * MQ_TIMEOUT_S < PREFILL_TIMEOUT_S
    assert point_at_server({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}, 5678)[
        "kv_connector_extra_config"]["lmcache.mp.mq_timeout"] == MQ_TIMEOUT_S


def test_server_args_carry_the_cpu_transfer_mode_and_options():
    [server] = plan_servers({"prefill": _p()}, LMCacheOptions(l1_size_gb=0.5, chunk_size=128), iter(_free(2)))
    args = server_args(server)
    flags = dict(zip(args[1::2], args[2::2]))
    assert args[0] == "server"
    assert flags["--supported-transfer-mode"] == "auto"
    assert flags["--l1-size-gb"] == "0.5" and flags["--chunk-size"] == "128" and flags["--eviction-policy"] == "LRU"
    assert flags["--port"] == str(server.port) and flags["--http-port"] == str(server.http_port)
    assert flags["--host"] == flags["--http-host"] == "127.0.0.1"


@pytest.mark.parametrize("options, field", [
    (LMCacheOptions(sharing="global"), "lmcache_sharing"),
    (LMCacheOptions(l1_size_gb=0), "lmcache_l1_size_gb"),
    (LMCacheOptions(chunk_size=0), "lmcache_chunk_size"),
    (LMCacheOptions(eviction_policy="FIFO"), "lmcache_eviction_policy"),
])
def test_bad_options_name_their_field(options, field):
    with pytest.raises(BadInput) as e:
        check_lmcache_options(options)
    assert e.value.fields[0] == field and e.value.fix


def _state(tmp_path: Path) -> ClusterState:
    rec = {"name": "lmcache-prefill", "serves": ["prefill"], "sharing": "per-instance",
           "url": "http://127.0.0.1:9", "port": 8, "http_port": 9, "options": {"chunk_size": 256},
           "pid": 1, "start_ticks": None, "command": [], "log_path": str(tmp_path / "lmcache-prefill.log")}
    inst = {"role": "prefill", "url": "http://127.0.0.1:1", "log_path": str(tmp_path / "p.log"),
            "kv_transfer_config": point_at_server(_p(), 8), "cwd": str(tmp_path)}
    return ClusterState.from_json({"name": "c", "runtime": "local", "model": "/m", "served_model_name": "m",
                                   "store": str(tmp_path), "created": "now", "lmcache": {rec["name"]: rec},
                                   "instances": {"prefill": inst, "decode": {**inst, "role": "decode",
                                                                             "kv_transfer_config": D}}})


def test_cluster_json_keeps_the_servers_and_verify_finds_the_offload_child(tmp_path):
    state = _state(tmp_path)
    again = ClusterState.from_json(state.to_json())
    assert again.lmcache == state.lmcache and "lmcache" in state.to_json()
    info = cluster_info(state)
    off = info.prefill.offload
    assert off is not None and off.server == "lmcache-prefill" and off.child == 1 and off.chunk_size == 256
    assert off.label == "LMCacheMPConnector (child 1)"
    assert info.decode.offload is None
    no_servers = state.to_json()
    del no_servers["lmcache"]
    assert cluster_info(no_servers).prefill.offload is None  # without kvctl's server nothing to read


def _lines(*items: tuple[str, int]) -> str:
    return "".join(f"[2026-12-02 00:02:53,791] LMCache INFO: {what} {n} tokens in 0.012 seconds "
                   f"(engine_driven_transfer.py:447:lmcache.v1.multiprocess.modules.engine_driven_transfer)\n"
                   for what, n in items)


def test_lmcache_lines_parse_and_drop_the_source_tag():
    text = _lines(("Stored", 512), ("Retrieved", 1024)) + "LMCache INFO: Stored 256 Q tokens in 0.1 seconds\n"
    found = lmcache_lines(text)
    assert [(x.what, x.tokens) for x in found] == [(ll.LMCACHE_STORED, 512), (ll.LMCACHE_RETRIEVED, 1024)]
    assert found[0].line.endswith("Stored 512 tokens in 0.012 seconds")


def test_offload_check_passes_on_stored_or_retrieved_whole_chunks():
    ok = check_offload_logged(_lines(("Stored", 512)), 543, 256, "LMCacheMPConnector (child 1)", "lmcache-prefill")
    assert ok.name == OFFLOAD_CHECK and ok.passed and "stored 512, retrieved 0 of 512" in ok.evidence
    hit = check_offload_logged(_lines(("Retrieved", 1024)), 1235, 256, "X", "s")
    assert hit.passed and "retrieved 1024" in hit.evidence
    short = check_offload_logged("", 15, 256, "X", "s")
    assert short.passed and "less than one 256-token chunk" in short.evidence


def test_offload_check_fails_naming_the_child():
    none = check_offload_logged("", 543, 256, "LMCacheMPConnector (child 1)", "lmcache-prefill")
    assert not none.passed and "LMCacheMPConnector (child 1)" in none.evidence and "no `Stored`" in none.evidence
    down = check_offload_logged("", 543, 256, "LMCacheMPConnector (child 1)", "lmcache-prefill",
                                server_down="its server at http://127.0.0.1:9 does not answer (ConnectError)")
    assert not down.passed and down.observable
    assert down.evidence.startswith("P's offload child LMCacheMPConnector (child 1) (LMCache server "
                                    "lmcache-prefill) failed: its server")
    part = check_offload_logged(_lines(("Stored", 256)), 543, 256, "X", "s")
    assert not part.passed and "not the prompt's 512 tokens" in part.evidence


def _pod(rendered, file: str, index: int = 1) -> dict:
    return rendered.manifests[file][index]["spec"]["template"]["spec"]


def test_render_k8s_runs_the_lmcache_server_as_a_native_sidecar_of_each_prefill_pod(tmp_path):
    from kvctl.k8s.check import check_documents
    from kvctl.k8s.render import K8sSpec, render_k8s

    rendered = render_k8s(K8sSpec(name="seed", prefill=2, scenario="v1-seed-replica"))
    assert check_documents(rendered.documents()).problems == []  # the client's models take them
    for i in (1, 3):  # each prefill Deployment (after its Service)
        pod = _pod(rendered, "prefill.yaml", i)
        [sidecar] = pod["initContainers"]
        assert sidecar["name"] == "lmcache" and sidecar["restartPolicy"] == "Always"
        assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthcheck"
        args = sidecar["args"]
        assert args[:3] == ["server", "--host", "127.0.0.1"] and "--supported-transfer-mode" in args
        config = pod["containers"][0]["args"][pod["containers"][0]["args"].index("--kv-transfer-config") + 1]
        assert '"lmcache.mp.host":"tcp://127.0.0.1","lmcache.mp.port":5555' in config
    assert "initContainers" not in _pod(rendered, "decode.yaml")  # D names no LMCache child
    assert "lmcache.yaml" not in rendered.manifests


def test_render_k8s_shared_lmcache_is_one_service(tmp_path):
    import yaml

    from kvctl.k8s.check import check_documents
    from kvctl.k8s.render import K8sSpec, render_k8s
    from kvctl.scenario.schema import scenario_file

    doc = yaml.safe_load(scenario_file("v1-seed-replica").read_text())
    doc["lmcache"]["sharing"] = "shared"
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(doc))
    rendered = render_k8s(K8sSpec(name="seed", prefill=2, scenario=str(path)))
    assert check_documents(rendered.documents()).problems == []
    service, deployment = rendered.manifests["lmcache.yaml"]
    assert service["metadata"]["name"] == "seed-lmcache" and deployment["kind"] == "Deployment"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][2] == "0.0.0.0"
    pod = _pod(rendered, "prefill.yaml")
    assert "initContainers" not in pod
    assert '"lmcache.mp.host":"tcp://seed-lmcache"' in " ".join(pod["containers"][0]["args"])


def test_docker_checks_the_image_holds_the_engine_and_the_extras_before_anything_starts(tmp_path):
    """The role's image must run the instance's engine and hold the extras its connectors need
    (labels of the images `kvctl image build` makes; the engine is not asked: labels given)."""
    from kvctl.runtime.base import InstanceSpec
    from kvctl.runtime.docker import DockerRuntime

    def runtime(labels: dict) -> DockerRuntime:
        rt = DockerRuntime(engines={"prefill": "v1", "decode": "v1"})
        rt._images = {r: ("img:1", labels) for r in ("prefill", "decode")}
        return rt

    def spec(cfg: dict, engine: str = "v1") -> InstanceSpec:
        return InstanceSpec(cluster="c", role="prefill", model=tmp_path, served_model_name="m", dtype="float32",
                            port=1, cwd=tmp_path, log_path=tmp_path / "p.log", kv_transfer_config=cfg,
                            engine=engine)

    v1_cpu = {"kvctl.device": "cpu", "kvctl.engine": "v1", "kvctl.extras": "nixl lmcache",
              "kvctl.sites": "/opt/kvctl/sites"}
    runtime(v1_cpu).check_instance(spec(_p()))  # the CPU V1 image: runs it
    with pytest.raises(BadInput) as e:  # the V0 CPU image (no engine label): wrong engine
        runtime({"kvctl.device": "cpu"}).check_instance(spec(_p()))
    assert e.value.fields == ("image",) and "runs vLLM engine v0" in e.value.what
    with pytest.raises(BadInput) as e:  # a V1 CPU image without LMCache
        runtime({"kvctl.device": "cpu", "kvctl.engine": "v1", "kvctl.extras": "nixl"}).check_instance(spec(_p()))
    assert e.value.fields == ("image",) and "'lmcache'" in e.value.what
    assert "`kvctl image build cpu` for engine v1" in e.value.fix
    runtime({"kvctl.device": "cpu", "kvctl.engine": "v1"}).check_instance(spec(D))  # no extra needed
    runtime({"kvctl.device": "gpu", "kvctl.engine": "v1"}).check_instance(spec(_p()))  # the GPU image's own
    runtime({}).check_instance(spec(_p()))  # an image that is not kvctl's: taken as it is
    # its servers get the extra's site-packages after the overlay, in the image's paths
    _, env = runtime(v1_cpu).command(spec(_p()), v1_cpu)
    assert env["PYTHONPATH"] == "/opt/kvctl/overlay:/opt/kvctl/sites/lmcache"
    assert "PYTHONPATH" not in runtime(v1_cpu).command(spec(D), v1_cpu)[1]  # the image's own


def test_where_instances_reach_their_lmcache_server(tmp_path):
    """Local: loopback. Docker: a bridged instance by the server's container name on the cluster's
    network, a host-network (NIXL) one at the published address; never across two engines."""
    from kvctl.cluster.lmcache import LMCacheServer
    from kvctl.cluster.lmcache_process import service_spec
    from kvctl.runtime.base import InstanceSpec
    from kvctl.runtime.docker import DockerRuntime, service_container_name
    from kvctl.runtime.docker_options import DockerOptions
    from kvctl.runtime.local import LocalRuntime

    service = service_spec(LMCacheServer("lmcache-prefill", ("prefill",), 5555, 5556), "c", "prefill", tmp_path)
    assert service.arguments("0.0.0.0")[:3] == ["server", "--host", "0.0.0.0"]
    assert service.ports == (5555, 5556) and service.url_port == 5556 and service.extra == "lmcache"

    def client(cfg: dict, role: str = "prefill") -> InstanceSpec:
        return InstanceSpec(cluster="c", role=role, model=tmp_path, served_model_name="m", dtype="float32",
                            port=1, cwd=tmp_path, log_path=tmp_path / "p.log", kv_transfer_config=cfg, engine="v1")

    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert LocalRuntime().service_host(service, client(_p())) == "127.0.0.1"
    docker = DockerRuntime()
    assert docker.service_host(service, client(_p())) == service_container_name(service)
    assert service_container_name(service).startswith("kvctl-c-lmcache-prefill-")
    assert docker.service_host(service, client(nixl)) == "127.0.0.1"
    two = DockerRuntime(DockerOptions(prefill_host="tcp://a:2375", decode_host="tcp://b:2375"))
    with pytest.raises(BadInput) as e:
        two.service_host(service, client(_p(), "decode"))
    assert e.value.fields == ("lmcache_sharing",)


def test_each_childs_evidence_is_its_own_field_and_column(tmp_path):
    """The seed's shape: P's transfer child's send line, its LMCache server's Stored/Retrieved lines
    and D's load line come back per request as separate parts (JSON `children`, one column each)."""
    from io import StringIO

    from rich.console import Console

    from kvctl.verify.children import request_children
    from kvctl.verify.markers import kv_sends
    from kvctl.verify.report import RequestReport, VerifyReport
    from kvctl.views.verify import render_children

    info = cluster_info(_state(tmp_path))
    key = "ab" * 16
    send = kv_sends(ll.KV_SEND % (0, key, 1111, 123456, 4.2, 1.0))[0]
    d_text = (ll.KV_LOAD_DONE % (0, "r1", "ff" * 16, 900, 899, 1, 0, 1, 1.0) + "\n"  # another request's
              + ll.KV_LOAD_DONE % (0, "r2", key, 1111, 1110, 1, 0, 2, 3.0) + "\n")
    parts = request_children(info.prefill.kv_transfer_config, info.decode.kv_transfer_config, "prefill",
                             "decode", send, key, d_text, info.prefill.offload,
                             _lines(("Stored", 768), ("Retrieved", 256)))
    doc = RequestReport(prompt="p", prompt_tokens=1111, key=key, children=parts).to_json()["children"]
    assert doc["transfer"] == {"instance": "prefill", "connector": "FSConnector", "child": 0, "tokens": 1111,
                               "bytes": 123456, "lines": [send.line]}
    assert doc["offload"]["connector"] == "LMCacheMPConnector" and doc["offload"]["child"] == 1
    assert (doc["offload"]["stored"], doc["offload"]["retrieved"], doc["offload"]["tokens"]) == (768, 256, 1024)
    assert len(doc["offload"]["lines"]) == 2
    assert doc["load"]["instance"] == "decode" and doc["load"]["connector"] == "FSConnector"
    assert (doc["load"]["child"], doc["load"]["tokens"], doc["load"]["computed"]) == (None, 1110, 1)
    assert key in doc["load"]["lines"][0]

    # nothing seen: each part says so (tokens None), none is dropped
    empty = request_children(info.prefill.kv_transfer_config, info.decode.kv_transfer_config, "prefill",
                             "decode", None, key, "", info.prefill.offload, "")
    assert [(c.part, c.tokens) for c in empty] == [("transfer", None), ("offload", None), ("load", None)]
    # a plain FS pair has no children
    assert request_children(D, D, "prefill", "decode", send, key, d_text) == []

    out = StringIO()
    render_children(VerifyReport("c", [RequestReport(prompt="p", prompt_tokens=1111, key=key, children=parts)], 16),
                    Console(file=out, width=200))
    text = out.getvalue()
    for header in ("P transfer: FSConnector (child 0)", "P offload: LMCacheMPConnector (child 1)",
                   "D load: FSConnector"):
        assert header in text, text
    assert "sent 1,111" in text and "stored 768 retrieved 256" in text and "loaded 1,110 computed 1" in text
