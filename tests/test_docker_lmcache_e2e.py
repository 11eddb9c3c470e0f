"""LMCache on the docker runtime, for real: the seed's V1 topology in containers of the CPU V1 image
(`kvctl image build cpu --engine v1`), P's LMCache server a container of it on the cluster's
docker network.

- `kvctl scenario run v1-seed-replica-docker`: P = MultiConnector [FSConnector transfer,
  LMCacheMPConnector offload], D = FSConnector, all three containers; every check passes with each
  child's evidence, and the second round, after P's container is replaced, is served by the LMCache
  server container (its retrieved count rises, outputs unchanged); nothing is left afterwards
  (containers, the cluster's network, processes).
- A launched cluster: P's connector points at the server's container name; status and `logs lmcache`
  show the server; the server's container killed mid-run: P recomputes, no wrong answer, verify
  names the offload child; `down` removes every container and the network.

Needs the Docker engine and the CPU V1 image (skipped without them, failed under
KVCTL_REQUIRE_DOCKER=1, where `make docker-ready` builds it). Holds the run-wide vLLM slot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest import Kvctl
from docker_helpers import cpu_image
from test_docker_runtime import _assert_nothing_left
from test_lmcache_e2e import (CHECKS5, D_CONFIG, P_CONFIG, _checks, _kvctl, _prompts, _verify,
                              assert_only_the_offload_child_failed)
from test_v1_cluster import LAUNCH_TIMEOUT_S, VERIFY_TIMEOUT_S, module_slot

from kvctl.cluster.lmcache import MQ_TIMEOUT_S

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(2400)]

__all__ = ["module_slot"]


@pytest.fixture(scope="module")
def v1_image(main_engine) -> str:
    return cpu_image(main_engine, "v1")


@pytest.fixture(scope="module")
def seed_replica_docker(tmp_path_factory, module_slot, main_engine, v1_image) -> tuple[Kvctl, dict]:
    run = _kvctl(tmp_path_factory, "docker-lmcache-scenario")
    res = run("scenario", "run", "v1-seed-replica-docker", "--json",
              timeout=LAUNCH_TIMEOUT_S + 2 * VERIFY_TIMEOUT_S)
    assert res.stdout, res
    return run, json.loads(res.stdout)


def test_v1_seed_replica_runs_in_containers_with_each_childs_evidence(seed_replica_docker, main_engine):
    run, doc = seed_replica_docker
    assert doc["passed"] is True and doc["exit_code"] == 0, json.dumps(doc, indent=1)[:4000]
    for req in doc["verify"]["requests"]:
        checks = _checks(req)
        assert sorted(checks) == sorted(CHECKS5) and all(c["passed"] for c in checks.values()), req
        offload = checks["offload_logged"]["evidence"]
        assert "LMCacheMPConnector (child 1)" in offload and "lmcache-prefill" in offload
        parts = req["children"]
        assert parts["transfer"]["connector"] == "FSConnector" and parts["transfer"]["tokens"] == req["prompt_tokens"]
        assert parts["offload"]["stored"] >= req["prompt_tokens"] // 256 * 256, parts
        assert parts["load"]["instance"] == "decode" and parts["load"]["tokens"] >= 1, parts
    rnd = doc["second_round"]
    assert rnd["restarted"] == ["prefill"] and rnd["passed"] and rnd["outputs_unchanged"], rnd
    lm = rnd["lmcache"]
    assert lm["retrieved_rose"] and lm["retrieved_tokens"]["after"] > lm["retrieved_tokens"]["before"], lm
    _assert_nothing_left(run.home, main_engine)


@pytest.fixture(scope="module")
def docker_cluster(tmp_path_factory, module_slot, main_engine, v1_image) -> Iterator[tuple[Kvctl, dict]]:
    run = _kvctl(tmp_path_factory, "docker-lmcache")
    res = run("launch", "1p1d", "--runtime", "docker", "--image", v1_image, "--engine", "v1", "--name", "dlmc",
              "--prefill-config", json.dumps(P_CONFIG), "--decode-config", json.dumps(D_CONFIG), "--json",
              timeout=LAUNCH_TIMEOUT_S)
    if res.rc != 0:
        run("down", "--name", "dlmc")
        pytest.fail(f"launch failed: {res}")
    yield run, json.loads(res.stdout)
    assert run("down", "--name", "dlmc").rc == 0
    _assert_nothing_left(run.home, main_engine)


def test_the_server_is_a_container_on_the_clusters_network(docker_cluster, main_engine):
    run, state = docker_cluster
    [(name, rec)] = state["lmcache"].items()
    assert name == "lmcache-prefill" and rec["runtime"] == "docker"
    container = main_engine.containers.get(rec["container_id"])
    assert container.status == "running" and container.labels["kvctl.role"] == "lmcache"
    prefill = main_engine.containers.get(state["instances"]["prefill"]["container_id"])
    networks = set(container.attrs["NetworkSettings"]["Networks"])
    assert networks & set(prefill.attrs["NetworkSettings"]["Networks"]), "P and its server share no network"
    extra = state["instances"]["prefill"]["kv_transfer_config"]["kv_connector_extra_config"]["connectors"][1]
    assert extra["kv_connector_extra_config"] == {"lmcache.mp.host": f"tcp://{rec['container_name']}",
                                                  "lmcache.mp.port": rec["port"],
                                                  "lmcache.mp.mq_timeout": MQ_TIMEOUT_S}
    status = json.loads(run("status", "--name", "dlmc", "--json").stdout)
    assert status["healthy"] and status["lmcache"][name]["healthy"] is True
    logs = run("logs", "lmcache", "--name", "dlmc")
    assert logs.rc == 0 and "LMCache cache server is running" in logs.stdout


def test_server_container_killed_p_recomputes_and_verify_names_the_offload_child(docker_cluster, main_engine):
    run, state = docker_cluster
    rc, doc = _verify(run, _prompts("warm", 1), "dlmc")
    assert rc == 0, doc  # the server stores while it runs
    main_engine.containers.get(state["lmcache"]["lmcache-prefill"]["container_id"]).kill()
    assert_only_the_offload_child_failed(*_verify(run, _prompts("killed", 2), "dlmc"))
    status = json.loads(run("status", "--name", "dlmc", "--json").stdout)
    assert status["lmcache"]["lmcache-prefill"]["running"] is False
    assert all(i["healthy"] for i in status["instances"].values())
