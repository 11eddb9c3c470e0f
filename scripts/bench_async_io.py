"""Issue 24's connector measurements, one run: V1 FSConnector with async loads and saves, a real model.

Run with the V1 rig's python (vLLM 0.32 CPU) and this checkout on PYTHONPATH:

    PYTHONPATH=. ~/.cache/kvctl/rigs/vllm-0.32.0-cpu-*/venv/bin/python scripts/bench_async_io.py MODEL_DIR OUT.json

(MODEL_DIR: `kvctl model get SmolLM2-135M-Instruct`'s directory.) It starts, under
$KVCTL_VLLM_SLOT_LOCK when set, P with FSConnector (kv_producer) and D with
FSConnector (kv_consumer) on one store, then P without any connector, and
measures with unique random-token prompts sent as token ids (/v1/completions):

- P's TTFT (max_tokens 1) and requests/s (8 prompts, 4 at a time), with saves
  and without any connector: `p_rps_fs_vs_plain`, `p_ttft_fs_vs_plain`;
- D's TTFT for a prompt P stored, at 2k and 4k tokens, against D's 1-token
  floor (the TTFT of a 1-token prompt on the same D): `d_ttft_store_vs_floor_<n>`;
  D recomputing the same size (a prompt not in the store) for scale.

Prints one JSON object (ratios and every raw figure) and writes it to OUT.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

NAME = "bench"
SIZES = (2048, 4096)
REPEATS = 3
RPS_PROMPTS, RPS_CONCURRENCY, RPS_TOKENS = 8, 4, 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, work: Path, name: str, kv: dict | None, bind: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "4608", "--max-num-batched-tokens", "4608"]
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1"}
    log = work / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def wait_ready(servers) -> None:
    deadline = time.monotonic() + 600
    for proc, url, log in servers:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)


def stop(servers) -> None:
    for proc, _, _ in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _, _ in servers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(url: str, tokens: list[int]) -> float:
    """Seconds for a 1-token completion of this prompt (= its TTFT)."""
    begin = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": tokens, "max_tokens": 1,
                                                  "temperature": 0}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - begin


rng = random.Random(24)


def prompt(n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def sends(log: Path) -> int:
    return log.read_text(errors="replace").count("KV send DONE.")


def p_figures(url: str) -> dict:
    ttft = [complete(url, prompt(RPS_TOKENS)) for _ in range(REPEATS)]
    batch = [prompt(RPS_TOKENS) for _ in range(RPS_PROMPTS)]
    begin = time.perf_counter()
    with ThreadPoolExecutor(RPS_CONCURRENCY) as pool:
        list(pool.map(lambda t: complete(url, t), batch))
    wall = time.perf_counter() - begin
    return {"ttft_s": ttft, "ttft_p50_s": statistics.median(ttft), "rps": RPS_PROMPTS / wall, "rps_wall_s": wall}


def main(model: Path, out: Path) -> None:
    lock_path = os.environ.get("KVCTL_VLLM_SLOT_LOCK")
    lock = open(lock_path, "w") if lock_path else None
    if lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    store = work / "store"
    store.mkdir()
    fs = lambda role: {"kv_connector": "FSConnector", "kv_role": role,  # noqa: E731
                       "kv_connector_module_path": "connectors.v1.fs_connector",
                       "kv_connector_extra_config": {"fs_storage_path": str(store)}}
    figures: dict = {"model": str(model), "tokens_rps": RPS_TOKENS, "sizes": list(SIZES)}
    pair = [start(model, work, "p", fs("kv_producer"), "0"), start(model, work, "d", fs("kv_consumer"), "1")]
    try:
        wait_ready(pair)
        (_, p_url, p_log), (_, d_url, d_log) = pair
        complete(p_url, prompt(64)), complete(d_url, prompt(64))  # warm both
        figures["p_fs"] = p_figures(p_url)
        floor = [complete(d_url, prompt(1)) for _ in range(REPEATS)]
        figures["d_floor_s"] = floor
        for n in SIZES:
            loaded, recompute = [], []
            for _ in range(REPEATS):
                tokens = prompt(n)
                before = sends(p_log)
                complete(p_url, tokens)
                deadline = time.monotonic() + 60
                while sends(p_log) == before and time.monotonic() < deadline:
                    time.sleep(0.01)  # the save is async: D asks once P published it
                loaded.append(complete(d_url, tokens))
                recompute.append(complete(d_url, prompt(n)))
            figures[f"d_store_{n}_s"], figures[f"d_recompute_{n}_s"] = loaded, recompute
        figures["d_loads_done"] = d_log.read_text(errors="replace").count("KV load DONE.")
    finally:
        stop(pair)
    plain = [start(model, work, "plain", None, "0")]
    try:
        wait_ready(plain)
        complete(plain[0][1], prompt(64))
        figures["p_plain"] = p_figures(plain[0][1])
    finally:
        stop(plain)
    med = statistics.median
    figures["ratios"] = {
        "p_rps_fs_vs_plain": figures["p_fs"]["rps"] / figures["p_plain"]["rps"],
        "p_ttft_fs_vs_plain": figures["p_fs"]["ttft_p50_s"] / figures["p_plain"]["ttft_p50_s"],
        **{f"d_ttft_store_vs_floor_{n}": med(figures[f"d_store_{n}_s"]) / med(figures["d_floor_s"]) for n in SIZES},
        **{f"d_ttft_store_vs_recompute_{n}": med(figures[f"d_store_{n}_s"]) / med(figures[f"d_recompute_{n}_s"])
           for n in SIZES},
    }
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
