"""A launched cluster has one endpoint: kvctl's router in front of P and D (issue: one endpoint per cluster).

Real vLLM servers from the CPU rig, the real router process that `kvctl launch`
starts, and the real `openai` SDK as the client: chat and completions,
streamed and not. The streamed text equals the non-streamed one and the
baseline (P generating everything), D served each request from the store
(its `skip model forwarding` line carries the request's key), one request id
reaches P and D, `kvctl verify` goes through the endpoint by default, and
`kvctl down` stops the router too.

The cluster is launched with an API key (from $KVCTL_API_KEY): the router, P and D
answer 401 on /v1/* without it (/health stays open), the openai SDK with it gets
200, no command line holds it, and kvctl's own verify sends it (from the cluster's
api_key file: the variable is gone by then).
"""

from __future__ import annotations

import fcntl
import json
import stat
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from e2e_helpers import slot_lock_path
from conftest import Kvctl, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

LAUNCH_TIMEOUT_S = 600
PROMPT = "Tell me where the KV cache of this prompt goes."
API_KEY = "sk-kvctl-e2e-7d2f61a9"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    """One cluster for the module, launched by the CLI with an API key (from $KVCTL_API_KEY,
    which later commands do not get), holding the run-wide vLLM slot."""
    home = tmp_path_factory.mktemp("router-home")
    kvctl = Kvctl(home)
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kvctl.env["KVCTL_API_KEY"] = API_KEY
        r = kvctl("launch", "1p1d", "--name", "rc", "--model", str(tiny_model), "--json",
                  timeout=LAUNCH_TIMEOUT_S)
        del kvctl.env["KVCTL_API_KEY"]
        assert r.rc == 0, r
        try:
            yield kvctl, json.loads(r.stdout)
        finally:
            kvctl("down", "--name", "rc")


def _skips(log: Path) -> int:
    return log.read_text().count("skip model forwarding")


def test_launch_records_the_endpoint_and_status_reports_it(cluster):
    kvctl, state = cluster
    assert state["endpoint"].startswith("http://127.0.0.1:") and state["router"]["url"] == state["endpoint"]
    assert pid_alive(state["router"]["pid"])
    st = json.loads(kvctl("status", "--name", "rc", "--json").stdout)
    assert st["endpoint"] == state["endpoint"] and st["endpoint_healthy"] is True and st["healthy"] is True
    assert httpx.get(f"{state['endpoint']}/health").status_code == 200


def test_openai_sdk_through_the_endpoint_chat_and_completions(cluster):
    kvctl, state = cluster
    client = openai.OpenAI(base_url=f"{state['endpoint']}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    assert model == state["served_model_name"]
    d_log = Path(state["instances"]["decode"]["log_path"])
    p_log = Path(state["instances"]["prefill"]["log_path"])
    skips = _skips(d_log)

    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0)
    chat = raw.parse().choices[0].message.content
    request_id = raw.headers["x-request-id"]
    assert raw.headers["x-kvctl-prefill"] == "prefill" and raw.headers["x-kvctl-decode"] == "decode"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat and chat

    # The baseline: P alone computes all 16 tokens of the same request.
    base = httpx.post(f"{state['instances']['prefill']['url']}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert chat == base

    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    comp_stream = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert comp == comp_stream and comp

    # Four requests through the router: D served each from the store, and one id reached P and D.
    assert _skips(d_log) - skips == 4
    assert request_id in p_log.read_text() and request_id in d_log.read_text()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def test_the_api_key_is_required_on_v1_everywhere_and_on_no_command_line(cluster):
    kvctl, state = cluster
    assert state["api_key_required"] is True and API_KEY not in json.dumps(state)
    body = {"model": state["served_model_name"], "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2, "temperature": 0}
    urls = {"endpoint": state["endpoint"], **{n: i["url"] for n, i in state["instances"].items()}}
    for name, url in urls.items():  # router, P and D: /v1 needs the key, /health does not
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401, name
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401, name
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200, name
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{state['endpoint']}/v1", api_key="wrong", max_retries=0).models.list()
    raw = openai.OpenAI(base_url=f"{state['endpoint']}/v1", api_key=API_KEY, max_retries=0) \
        .chat.completions.with_raw_response.create(model=body["model"], messages=body["messages"], max_tokens=2)
    assert raw.http_response.status_code == 200 and raw.parse().choices[0].message.content is not None

    # The key is in the servers' and the router's environment, never on a command line.
    assert API_KEY not in subprocess.run(["ps", "-ewwo", "args"], capture_output=True, text=True).stdout
    for inst in state["instances"].values():
        assert _environ(inst["pid"]).get("VLLM_API_KEY") == API_KEY
    assert _environ(state["router"]["pid"]).get("KVCTL_ROUTER_API_KEY") == API_KEY
    key_file = kvctl.home / "clusters" / "rc" / "api_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.read_text().strip() == API_KEY
    st = kvctl("status", "--name", "rc", "--json")
    assert st.rc == 0 and API_KEY not in st.stdout + st.stderr
    assert json.loads(st.stdout)["api_key_required"] is True


def test_verify_goes_through_the_endpoint_by_default(cluster):
    kvctl, state = cluster
    router_log = Path(state["router"]["log_path"])
    routed = router_log.read_text().count("routed id=")
    r = kvctl("verify", "--name", "rc", "--json", "--prompt", "One endpoint, two servers.", timeout=300)
    assert r.rc == 0, r
    assert json.loads(r.stdout)["passed"] is True
    assert router_log.read_text().count("routed id=") == routed + 1  # the request went through the router
    direct = kvctl("verify", "--name", "rc", "--json", "--direct", "--prompt", "Straight to P and D.", timeout=300)
    assert direct.rc == 0, direct
    assert router_log.read_text().count("routed id=") == routed + 1  # --direct bypasses it


def test_bench_serve_hands_the_key_to_the_load_tool(cluster):
    """`vllm bench serve` sends the cluster's key (its OPENAI_API_KEY) to the endpoint; the
    plain target here is P itself (no server to start), which requires the key too."""
    kvctl, state = cluster
    r = kvctl("bench", "serve", "rc", "--plain-url", state["instances"]["prefill"]["url"], "--requests", "2",
              "--input-len", "16", "--output-len", "2", "--json", timeout=300)
    assert r.rc == 0, r
    report = json.loads(r.stdout)
    assert (report["pd"]["completed"], report["pd"]["failed"]) == (2, 0)
    assert (report["plain"]["completed"], report["plain"]["failed"]) == (2, 0)


def test_down_stops_the_router(cluster):
    kvctl, state = cluster
    d = kvctl("down", "--name", "rc", "--json")
    assert d.rc == 0, d
    assert "router" in {s["role"] for s in json.loads(d.stdout)["stopped"]}
    assert not pid_alive(state["router"]["pid"])
