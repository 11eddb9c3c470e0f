"""A cluster launched with an API key (`kvctl launch 1p1d|pd --api-key KEY`, or $KVCTL_API_KEY).

Light checks, no vLLM server: the key is validated (an empty one names `api_key`),
reaches each server as VLLM_API_KEY in its environment (local and docker) and the
router as KVCTL_ROUTER_API_KEY, never on a command line or in cluster.json; kvctl
keeps it in the cluster's `api_key` file (mode 0600) and sends it on every request
(VLLMClient, verify, bench serve's load tool); `status --json` says only
`"api_key_required": true`. Also: `launch --engine v2` names --engine, and a launch
that fails before any server starts leaves no cluster dir behind.
The real cluster (401 without the key, 200 with it, verify, ps) is in
test_router_cluster_e2e.py.
"""

from __future__ import annotations

import json
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvctl.client import VLLMClient, user_messages
from kvctl.cluster.lifecycle import instance_specs
from kvctl.cluster.router_process import ROUTER_API_KEY_ENV
from kvctl.cluster.spec import build_1p1d_spec, build_pd_spec
from kvctl.cluster.state import (
    API_KEY_FILE,
    ClusterState,
    InstanceRecord,
    cluster_api_key,
    cluster_dir,
    load_api_key,
    load_cluster,
    remove_state,
    save_api_key,
    save_cluster,
    utc_now,
)
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.runtime.base import vllm_server_args, vllm_server_env
from kvctl.runtime.local import LocalRuntime
from kvctl.verify.cluster_info import cluster_info

KEY = "sk-test-4f1c9e"


# ---------------------------------------------------------------- the spec

@pytest.mark.parametrize("bad", ["", "   ", "two words", "line\nbreak"])
def test_a_key_that_is_empty_or_unfit_for_a_header_names_api_key(kvctl_home, model_dir, bad):
    with pytest.raises(BadInput) as e:
        build_1p1d_spec(name="k", model=model_dir, api_key=bad)
    assert e.value.fields == ("api_key",)


def test_the_key_reaches_every_server_in_its_environment_never_its_command_line(kvctl_home, model_dir):
    spec = build_pd_spec(prefill=2, decode=1, name="k", model=model_dir, api_key=KEY)
    assert spec.api_key == KEY and KEY not in repr(spec)
    specs = instance_specs(spec)
    assert sorted(specs) == ["decode-0", "prefill-0", "prefill-1"]
    runtime = LocalRuntime(python=Path("/usr/bin/python3"))
    for ispec in specs.values():
        assert vllm_server_env(ispec)["VLLM_API_KEY"] == KEY
        assert KEY not in " ".join(runtime.command(ispec)) and KEY not in repr(ispec)
        assert KEY not in " ".join(vllm_server_args(ispec, model="m", host="0.0.0.0"))
    plain = instance_specs(build_1p1d_spec(name="n", model=model_dir))
    assert all("VLLM_API_KEY" not in vllm_server_env(s) for s in plain.values())


def test_docker_containers_get_the_key_in_their_environment(kvctl_home, model_dir):
    pytest.importorskip("docker")
    from kvctl.runtime.docker import DockerRuntime

    spec = build_1p1d_spec(name="k", model=model_dir, api_key=KEY)
    ispec = instance_specs(spec)["prefill"]
    config = DockerRuntime.for_cluster(spec).container_config(ispec, "kvctl-cpu:x", {"kvctl.python": "python3"})
    assert config["environment"]["VLLM_API_KEY"] == KEY
    assert KEY not in " ".join(config["command"]) and KEY not in json.dumps(config["labels"])


def test_the_router_reads_its_key_where_kvctl_puts_it(monkeypatch):
    import typer

    from kvctl.router.__main__ import serve_cmd, single_command_app  # what `python -m kvctl.router` runs

    monkeypatch.setenv(ROUTER_API_KEY_ENV, "k-env")
    ctx = typer.main.get_command(single_command_app(serve_cmd)).make_context(
        "router", ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"])
    assert ctx.params["api_key"] == "k-env"


# ---------------------------------------------------------------- the state

def _state(name: str, required: bool) -> ClusterState:
    state = ClusterState(name=name, runtime="local", model="/m", served_model_name="m", store="/s",
                         created=utc_now(), api_key_required=required)
    for i, role in enumerate(("prefill", "decode")):  # pids no process has: status says they are down
        state.instances[role] = InstanceRecord(
            role=role, url=f"http://127.0.0.1:{9 + i}", log_path="/nonexistent.log", kv_transfer_config=None,
            cwd="/", runtime_fields={"pid": 2**22 + 7 + i, "start_ticks": 1, "command": ["vllm"]})
    return state


def test_the_key_file_is_mode_0600_and_removed_with_the_state(kvctl_home, monkeypatch):
    monkeypatch.delenv("KVCTL_API_KEY", raising=False)
    save_cluster(_state("k", True))
    path = save_api_key("k", KEY)
    assert path == cluster_dir("k") / API_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_api_key("k") == KEY == cluster_api_key("k")
    assert KEY not in (cluster_dir("k") / "cluster.json").read_text()
    assert load_cluster("k").api_key_required is True
    remove_state("k")
    assert not path.exists() and load_api_key("k") is None and cluster_api_key("k") is None


def test_without_the_file_the_key_comes_from_the_environment(kvctl_home, monkeypatch):
    monkeypatch.setenv("KVCTL_API_KEY", "from-env")
    assert cluster_api_key("attached-one") == "from-env"
    save_api_key("launched", KEY)
    assert cluster_api_key("launched") == KEY  # the cluster's own key wins
    assert cluster_info(_state("attached-one", False)).api_key == "from-env"


def test_status_json_says_a_key_is_required_and_never_shows_it(kvctl, kvctl_home):
    save_cluster(_state("k", True))
    save_api_key("k", KEY)
    save_cluster(_state("open", False))
    one = kvctl("status", "--name", "k", "--json")
    assert KEY not in one.stdout + one.stderr
    assert json.loads(one.stdout)["api_key_required"] is True
    every = kvctl("status", "--json")
    assert KEY not in every.stdout + every.stderr
    by_name = {c["name"]: c for c in json.loads(every.stdout)["clusters"]}
    assert by_name["k"]["api_key_required"] is True and "api_key_required" not in by_name["open"]


# ---------------------------------------------------------------- kvctl's requests carry it

class _Recorder(BaseHTTPRequestHandler):
    """Answers like vLLM with VLLM_API_KEY set: /v1/* needs the key, /health and /tokenize do not."""

    seen: list[tuple[str, str | None]] = []
    key: str | None = KEY

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        auth = self.headers.get("Authorization")
        self.seen.append((self.path, auth))
        if self.path.startswith("/v1") and auth != f"Bearer {self.key}":
            return self._answer(401, {"error": "Unauthorized"})
        if self.path == "/tokenize":
            return self._answer(200, {"tokens": [1, 2, 3]})
        if self.path == "/v1/models":
            return self._answer(200, {"data": [{"id": "m", "root": "/m"}]})
        if self.path == "/v1/chat/completions":
            return self._answer(200, {"id": "x", "choices": [{"message": {"content": "hi"}}]})
        return self._answer(200, {})

    do_GET = do_POST = _handle

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    _Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_vllm_client_sends_the_key_on_every_request(server):
    with VLLMClient(server, "m", role="decode", api_key=KEY) as client:
        assert client.health()
        assert client.tokenize_chat(user_messages("x")) == [1, 2, 3]
        assert client.chat(user_messages("x"), max_tokens=1).text == "hi"
    assert [p for p, _ in _Recorder.seen] == ["/health", "/tokenize", "/v1/chat/completions"]
    assert all(auth == f"Bearer {KEY}" for _, auth in _Recorder.seen)


def test_vllm_client_without_the_key_gets_a_401_that_says_so(server):
    with VLLMClient(server, "m", role="decode") as client:
        assert client.health()  # /health stays open
        with pytest.raises(RuntimeFailure) as e:
            client.chat(user_messages("x"), max_tokens=1)
    assert "401" in e.value.what and "API key" in e.value.what
    assert all(auth is None for _, auth in _Recorder.seen)


def test_attach_asks_the_served_model_name_with_the_key_from_the_environment(server, monkeypatch):
    from kvctl.attach.attach import served_model_name

    monkeypatch.delenv("KVCTL_API_KEY", raising=False)
    with pytest.raises(BadInput):
        served_model_name(server)
    monkeypatch.setenv("KVCTL_API_KEY", KEY)
    assert served_model_name(server) == ("m", "/m")


def test_bench_serve_hands_the_key_to_the_load_tool_through_its_environment(monkeypatch, tmp_path):
    from kvctl.bench.serve import ServeOptions, tool_argv, tool_env

    monkeypatch.setenv("OPENAI_API_KEY", "someone-elses")
    assert tool_env(KEY)["OPENAI_API_KEY"] == KEY
    assert "OPENAI_API_KEY" not in tool_env(None)
    argv = tool_argv(Path("/py"), "http://127.0.0.1:1", "m", tmp_path, ServeOptions(), tmp_path, "pd")
    assert KEY not in " ".join(argv)


# ---------------------------------------------------------------- launch inputs

def test_launch_with_an_unknown_engine_names_the_engine_option(kvctl, model_dir):
    r = kvctl("launch", "1p1d", "--engine", "v2", "--name", "e", "--model", str(model_dir), "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert err["where"] == "--engine" and "v2" in err["error"]


@pytest.mark.parametrize("command", [["1p1d"], ["pd", "--prefill", "1", "--decode", "1"]])
def test_an_empty_key_is_refused_from_the_option_and_the_environment(kvctl, model_dir, command):
    r = kvctl("launch", *command, "--api-key", "", "--name", "e", "--model", str(model_dir), "--json")
    assert r.rc == 2 and json.loads(r.stdout)["where"] == "--api-key", r
    kvctl.env["KVCTL_API_KEY"] = ""
    r = kvctl("launch", *command, "--name", "e", "--model", str(model_dir), "--json")
    assert r.rc == 2 and json.loads(r.stdout)["where"] == "$KVCTL_API_KEY", r


def test_a_launch_failing_before_any_server_leaves_no_cluster_dir(kvctl, kvctl_home, model_dir):
    kvctl.env["KVCTL_RIG_V1_PYTHON"] = "/nonexistent/python"
    r = kvctl("launch", "1p1d", "--engine", "v1", "--name", "x", "--model", str(model_dir),
              "--api-key", KEY, "--json")
    assert r.rc == 2, r
    assert "KVCTL_RIG_V1_PYTHON" in json.loads(r.stdout)["error"]
    assert not (kvctl_home / "clusters" / "x").exists()
    assert KEY not in r.stdout + r.stderr
