"""`kvctl bench serve` on real vLLM servers: a launched 1P1D cluster behind its router, the
same servers attached (with log files and a log command, and with no logs at all), and
Ctrl-C while the plain server starts.

The load tool is the rig's `vllm bench serve`; the numbers are kept small (a few
requests, 8 output tokens) for this 2-core machine. One module-scoped launch serves
every test (it holds the run-wide vLLM slot).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Kvctl
from e2e_helpers import launched_by_cli

from kvctl.bench import serve
from kvctl.bench.common import quiet
from kvctl.cluster.state import load_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

LAUNCH_TIMEOUT_S = 600
BENCH_TIMEOUT_S = 900
SMALL = ("--requests", "6", "--concurrency", "2", "--input-len", "32", "--output-len", "8", "--json")


@pytest.fixture(scope="module")
def src(tmp_path_factory, shared_dir, rig_python, tiny_model) -> Iterator[tuple[Kvctl, dict]]:
    """`kvctl launch 1p1d --name src`, held for the module (tests/e2e_helpers.py)."""
    with launched_by_cli(tmp_path_factory, shared_dir, "src", "launch", "1p1d", "--model", str(tiny_model),
                         timeout=LAUNCH_TIMEOUT_S) as launched:
        yield launched


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def _check_target(figures: dict, requests: int) -> None:
    assert figures["completed"] == requests and figures["failed"] == 0, figures
    for metric in ("ttft_ms", "itl_ms"):
        assert _positive(figures[metric]["p50"]) and _positive(figures[metric]["p99"]), figures
    assert _positive(figures["requests_per_s"]) and _positive(figures["output_tokens_per_s"])


def _gone(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return True
    return False


def test_launched_cluster_side_by_side(src):
    kvctl, state = src
    r = kvctl("bench", "serve", "src", *SMALL, timeout=BENCH_TIMEOUT_S)
    assert r.rc == 0, r
    result = json.loads(r.stdout)
    assert set(result["ratios"]) == set(serve.RATIO_KEYS)
    assert all(_positive(v) for v in result["ratios"].values()), result["ratios"]
    _check_target(result["pd"], 6)
    _check_target(result["plain"], 6)
    assert result["pd"]["url"] == state["endpoint"]
    assert result["store"]["fraction"] > 0 and result["pd"]["store_fraction"] == result["store"]["fraction"]
    assert result["load_tool"]["name"] == "vllm bench serve"
    assert result["plain"]["launched"] is True and _gone(result["plain"]["url"])  # always torn down
    assert "plain: server stopped" in r.stderr and "pd: 6/6 requests done" in r.stderr  # progress
    plain_log = Path(state["instances"]["decode"]["log_path"]).parent / "bench-plain.log"
    assert "--kv-transfer-config" not in plain_log.read_text().splitlines()[0]  # no KV transfer


@pytest.fixture
def plain_url(src, monkeypatch) -> Iterator[str]:
    """A plain server beside src (the one bench serve would launch), for --plain-url."""
    kvctl, _ = src
    for key in ("KVCTL_HOME", "KVCTL_RIG_PYTHON"):
        if key in kvctl.env:
            monkeypatch.setenv(key, kvctl.env[key])
    with serve.plain_server(load_cluster("src"), quiet) as url:
        yield url


def _attach(kvctl: Kvctl, state: dict, name: str, *logs: str) -> None:
    p, d = state["instances"]["prefill"], state["instances"]["decode"]
    r = kvctl("attach", name, "--prefill", p["url"], "--decode", d["url"], "--endpoint", state["endpoint"],
              *logs, "--json")
    assert r.rc == 0, r


def test_attached_cluster_with_plain_url(src, plain_url):
    kvctl, state = src
    d_log = state["instances"]["decode"]["log_path"]
    _attach(kvctl, state, "att", "--prefill-log", state["instances"]["prefill"]["log_path"],
            "--decode-log", f"cmd:tail -n 0 -F {d_log}")
    r = kvctl("bench", "serve", "att", "--plain-url", plain_url, *SMALL, timeout=BENCH_TIMEOUT_S)
    assert r.rc == 0, r
    result = json.loads(r.stdout)
    _check_target(result["pd"], 6)
    assert result["plain"]["url"] == plain_url and result["plain"]["launched"] is False
    assert all(_positive(v) for v in result["ratios"].values()), result["ratios"]
    assert result["store"]["fraction"] > 0, result["store"]  # D's log through its log command

    _attach(kvctl, state, "blind")  # no log sources: the fraction cannot be observed
    r = kvctl("bench", "serve", "blind", "--plain-url", plain_url, "--requests", "2", "--concurrency", "2",
              "--input-len", "16", "--output-len", "4", "--json", timeout=BENCH_TIMEOUT_S)
    assert r.rc == 0, r
    result = json.loads(r.stdout)
    assert result["store"]["fraction"] is None and result["pd"]["store_fraction"] is None
    assert "not observable" in result["store"]["reason"] and "decode" in result["store"]["reason"]
    assert _positive(result["ratios"]["ttft_p50"])


def test_ctrl_c_while_the_plain_server_starts_stops_it(src):
    kvctl, _ = src
    proc = kvctl.popen("bench", "serve", "src", "--requests", "2")
    port = None
    deadline = time.monotonic() + 120
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), True)
    while time.monotonic() < deadline and port is None:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"plain: starting a vLLM server .* on port (\d+)", line)
        if m:
            port = int(m.group(1))
    assert port is not None, "the plain server never started"
    time.sleep(2)  # it is starting
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    assert rc == 130, proc.stderr.read()
    pattern = f"--port {port} "
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, pattern)]
    assert left == [], left


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
