"""NIXL P/D on CPU, for real: `kvctl launch 1p1d --engine v1 --transfer nixl`, two vLLM 0.32
servers with vLLM's NixlConnector (UCX over tcp+cma), kvctl's router doing the
kv_transfer_params handshake, verify reading vLLM's own NIXL lines per request.

One module-scoped cluster (holding the run-wide vLLM slot): verify through the
router and --direct pass every check; the openai SDK through the endpoint equals P's
own full answer (chat and completions, streamed or not); a D that recomputes (no
kv_transfer_params) and a D sent to a side channel nobody listens on (a failed NIXL
handshake) fail the checks with the reason. Skipped without the V1 rig or the nixl
extra; failed under KVCTL_REQUIRE_RIG_V1=1.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Kvctl, live_processes_under
from e2e_helpers import slot_lock_path
from test_v1_e2e import V1_PYTHON_ENV, _python_or_skip

from kvctl.cluster import nixl
from kvctl.cluster.state import load_cluster
from kvctl.runtime.local import server_tmp_dir
from kvctl.verify.checks import CHECKS
from kvctl.verify.cluster_info import cluster_info
from kvctl.verify.verifier import ClusterVerifier

openai = pytest.importorskip("openai")

# The module's cluster waits for the run-wide vLLM slot in its first test's setup.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(3600)]

LAUNCH_TIMEOUT_S = 600
PROMPT = "Tell me about the sea, the sky and the long road between them. " * 6  # > one 128-token block


def require_nixl(python: str) -> None:
    """Skip (fail under KVCTL_REQUIRE_RIG_V1=1) unless the nixl extra is installed on the V1 rig."""
    from kvctl.provision import extras, rig

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(V1_PYTHON_ENV, python)
        if not extras.extra_status(extras.NIXL, rig.engine_spec("v1"))["installed"]:
            if os.environ.get("KVCTL_REQUIRE_RIG_V1") == "1":
                pytest.fail("the nixl extra is not installed (make rig-v1 installs it)")
            pytest.skip("the nixl extra is not installed: `kvctl rig install --engine v1 --extra nixl`")


@pytest.fixture(scope="module")
def nixl_cluster(request, tmp_path_factory, shared_dir: Path) -> Iterator[tuple[Kvctl, dict]]:
    python = _python_or_skip("v1")
    run = Kvctl(tmp_path_factory.mktemp("nixl-home"))
    run.env[V1_PYTHON_ENV] = str(python)
    require_nixl(str(python))
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        lease = getattr(request.module, "NIXL_LEASE_S", None)  # the lease fault's module shortens it
        configs = [] if lease is None else [
            a for role in ("prefill", "decode") for a in (
                f"--{role}-config", json.dumps({**nixl.default_config(role, 2),
                                                "kv_connector_extra_config": {"kv_lease_duration": lease}}))]
        res = run("launch", "1p1d", "--runtime", "local", "--name", "nx", "--engine", "v1", "--transfer", "nixl",
                  *configs, "--json", timeout=LAUNCH_TIMEOUT_S)
        if res.rc != 0:
            run("down", "--name", "nx")
            pytest.fail(f"launch failed: {res}")
        state = json.loads(res.stdout)
        state["launch_s"] = time.monotonic() - t0
        try:
            yield run, state
        finally:
            run("down", "--name", "nx")
            assert live_processes_under(run.home) == []


VERIFY_PROMPTS = ("Hello, how are you?", PROMPT)  # shorter than one block, and several blocks


def _verify(run: Kvctl, *args: str) -> dict:
    prompts = [a for p in VERIFY_PROMPTS for a in ("--prompt", p)]
    res = run("verify", "--name", "nx", "--json", "--max-tokens", "8", *prompts, *args, timeout=900)
    doc = json.loads(res.stdout)
    if res.rc != 0:
        logs = run.home / "clusters" / "nx" / "logs"
        lines = [f"{f.name}: {line}" for f in sorted(logs.glob("*.log")) for line in f.read_text(errors="replace")
                 .splitlines() if "NIXL" in line or "KV transfer" in line or "Releasing" in line][-40:]
        pytest.fail(json.dumps(doc, indent=1)[:6000] + "\n" + "\n".join(lines))
    return doc


def test_v1_servers_keep_their_temp_files_in_a_dir_of_their_own(nixl_cluster):
    """vLLM V1's IPC sockets (and its torch.distributed file store) go to each server's own TMPDIR,
    which `kvctl down` removes, not loose into the system temp dir."""
    _, state = nixl_cluster
    for inst in state["instances"].values():
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{inst['pid']}/environ").read_text().split("\0")
                   if "=" in kv)
        tmp = Path(env["TMPDIR"])
        assert tmp == server_tmp_dir(Path(inst["log_path"])), env["TMPDIR"]
        assert env["TORCH_COMPILE_DISABLE"] == "1"  # no inductor build on the first logprobs request
        sockets = [p for p in tmp.iterdir() if p.is_socket()]
        assert sockets, sorted(p.name for p in tmp.iterdir())  # the API server's and engine's ZMQ sockets


@pytest.mark.parametrize("mode", [(), ("--direct",)], ids=["endpoint", "direct"])
def test_verify_passes_every_check_on_nixl_evidence(nixl_cluster, mode):
    run, state = nixl_cluster
    doc = _verify(run, *mode)
    assert doc["passed"] is True and doc["requests"]
    for req in doc["requests"]:
        checks = {c["name"]: c for c in req["checks"]}
        assert set(checks) == set(CHECKS)
        assert all(c["passed"] and c.get("observable", True) for c in checks.values()), checks
        assert "Finished sending KV transfer for request" in checks["kv_send_logged"]["evidence"]
        assert req["request_id"] in checks["kv_send_logged"]["evidence"]
        assert "computed=0 of prompt_tokens=" in checks["decode_skipped_forward"]["evidence"]
        assert "handed" in checks["store_entry_written"]["evidence"]


def test_the_sdk_through_the_endpoint_equals_ps_full_answer(nixl_cluster):
    run, state = nixl_cluster
    ep = openai.OpenAI(base_url=f"{state['endpoint']}/v1", api_key="x", max_retries=0, timeout=120)
    p = openai.OpenAI(base_url=f"{state['instances']['prefill']['url']}/v1", api_key="x", max_retries=0, timeout=120)
    model = state["served_model_name"]
    messages = [{"role": "user", "content": PROMPT}]
    kw = dict(model=model, max_tokens=12, temperature=0)
    want_chat = p.chat.completions.create(messages=messages, **kw).choices[0].message.content
    want_text = p.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert ep.chat.completions.create(messages=messages, **kw).choices[0].message.content == want_chat
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       ep.chat.completions.create(messages=messages, stream=True, **kw) if c.choices)
    assert streamed == want_chat
    assert ep.completions.create(prompt=PROMPT, **kw).choices[0].text == want_text
    streamed = "".join(c.choices[0].text for c in ep.completions.create(prompt=PROMPT, stream=True, **kw)
                       if c.choices)
    assert streamed == want_text


def _direct_decode(state: dict, request_id: str, params: dict | None) -> httpx.Response:
    body = {"model": state["served_model_name"], "messages": [{"role": "user", "content": PROMPT + request_id}],
            "max_tokens": 4, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{state['instances']['decode']['url']}/v1/chat/completions", json=body,
                      headers={"X-Request-Id": request_id}, timeout=120)


def _checks(run: Kvctl, request_id: str, prompt: str, p_start, d_start) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCTL_HOME", str(run.home))
        info = cluster_info(load_cluster("nx"))
        with ClusterVerifier(info, log_wait_s=8.0) as v:
            tokens = v.prefill.tokenize_chat([{"role": "user", "content": prompt}])
            sent, handed, pulled = v.nixl_checks(request_id, tokens, v.p_log, p_start, v.d_log, d_start)
    return {c.name: c for c in (sent, handed, pulled)}


def _offsets(run: Kvctl):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCTL_HOME", str(run.home))
        with ClusterVerifier(cluster_info(load_cluster("nx"))) as v:
            return v.p_log.offset(), v.d_log.offset()


def test_a_decode_that_recomputes_fails_with_the_reason(nixl_cluster):
    run, state = nixl_cluster
    p_start, d_start = _offsets(run)
    assert _direct_decode(state, "recompute-1", None).status_code == 200  # D answers, from its own prefill
    checks = _checks(run, "recompute-1", PROMPT + "recompute-1", p_start, d_start)
    assert not checks["decode_skipped_forward"].passed
    assert "pulled nothing and recomputed the prompt" in checks["decode_skipped_forward"].evidence
    assert not checks["kv_send_logged"].passed and not checks["store_entry_written"].passed


def test_a_failed_handshake_fails_verify_naming_it(nixl_cluster):
    """D is sent to a side channel nobody listens on (as with a wrong VLLM_NIXL_SIDE_CHANNEL_HOST on P):
    it cannot pull, and the checks say so instead of passing a recomputed answer."""
    run, state = nixl_cluster
    p_start, d_start = _offsets(run)
    prompt = PROMPT + "handshake-1"
    p_answer = httpx.post(f"{state['instances']['prefill']['url']}/v1/chat/completions", json={
        "model": state["served_model_name"], "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}},
        headers={"X-Request-Id": "handshake-1"}, timeout=120).json()
    params = dict(p_answer["kv_transfer_params"])
    # An engine D never met, at a port nothing listens on: D must handshake, and cannot.
    params.update(remote_port=1, remote_engine_id="kvctl-no-such-engine")
    started = time.monotonic()
    answer = _direct_decode(state, "handshake-1", params)
    checks = _checks(run, "handshake-1", prompt, p_start, d_start)
    failed = {n: c for n, c in checks.items() if not c.passed}
    assert "decode_skipped_forward" in failed and "kv_send_logged" in failed, checks
    print(f"failed handshake: D answered {answer.status_code} after {time.monotonic() - started:.1f} s; "
          f"{failed['decode_skipped_forward'].evidence}")
