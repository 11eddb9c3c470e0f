"""A hung store never stalls vLLM (V1): P and D on a FUSE store whose daemon is stopped, then continued.

The store is a passthrough FUSE mount (tests/fuse_mount.py); SIGSTOP to its
daemon makes every call on it block in the kernel, as a stalled network
filesystem does. Both servers run FSConnector with store_timeout_ms=1000.
Checked, in one flow on one module-scoped pair:

- a request whose entry is on the stalled store completes by recompute
  within the deadline plus its normal time (D logs "the store did not answer
  within 1000 ms"), with the output of a plain run;
- requests whose prompts are not in the store keep completing during the
  stall, on D and on P, without waiting for the deadline (P drops their saves,
  logged);
- after SIGCONT the store is used again (P publishes, D loads);
- no thread is leaked (each server's thread count is what it was before);
- nothing is served wrong (every D output equals P's plain output).

The figures (latencies normal / during the stall, the longest wait) are
printed as one JSON line, `hung-store figures: {...}` (pytest -s shows it).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from fuse_mount import hangable_mount
from kvctl.verify import markers
from test_v1_e2e import Cluster, prompt_of, running, slot, start_v1, v1_python  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]

TIMEOUT_MS = 1000
TIMEOUT_S = TIMEOUT_MS / 1e3
REASON = f"the store did not answer within {TIMEOUT_MS} ms"


def fs_config(role: str, store: Path) -> dict:
    cfg = {"kv_connector": "FSConnector", "kv_role": role,
           "kv_connector_extra_config": {"fs_storage_path": str(store), "fsync": False,
                                         "store_timeout_ms": TIMEOUT_MS}}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@pytest.fixture(scope="module")
def hung(slot, v1_python, tiny_model, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("hung-store")
    with hangable_mount(work / "backing", work / "store") as mount:
        p = start_v1(v1_python, tiny_model, "p", work, fs_config("kv_producer", mount.path), "0")
        d = start_v1(v1_python, tiny_model, "d", work, fs_config("kv_consumer", mount.path), "1")
        with running([p, d]) as start_s:
            yield Cluster(p, d, mount.path, start_s), mount


def threads_of(server) -> int:
    """Threads in the server's process group (API server, engine core, workers)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) == server.proc.pid:
                total += len(os.listdir(f"/proc/{pid}/task"))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return total


def timed(fn):
    begin = time.monotonic()
    value = fn()
    return value, time.monotonic() - begin


def test_a_hung_store_never_stalls_the_engine(hung):
    c, mount = hung
    # The store works: P publishes, D loads; then each server's normal latency, store healthy.
    warm = prompt_of(30, "warm ")
    key = c.sent_key(c.prefill(warm))
    assert c.chat(c.d, warm) == c.chat(c.p, warm)
    assert c.load_for(key).outcome == "DONE"
    normal_d = statistics.median(timed(lambda i=i: c.chat(c.d, prompt_of(20, f"normal {i} ")))[1]
                                 for i in range(3))
    normal_p = statistics.median(timed(lambda i=i: c.prefill(prompt_of(20, f"normal p {i} ")))[1]
                                 for i in range(3))
    stored = prompt_of(35, "stored before the stall ")
    stored_key = c.sent_key(c.prefill(stored))
    plain = {stored: c.chat(c.p, stored)}
    during = [prompt_of(20, f"during the stall {i} ") for i in range(4)]
    plain.update({prompt: c.chat(c.p, prompt) for prompt in during})
    threads_before = {s.name: threads_of(s) for s in (c.p, c.d)}

    mount.stop()
    stall_begin = time.monotonic()
    try:
        hit, hit_s = timed(lambda: c.chat(c.d, stored))  # meets the stalled store
        misses_d = [timed(lambda p=p: c.chat(c.d, p)) for p in during]
        misses_p = [timed(lambda i=i: c.prefill(prompt_of(20, f"p during the stall {i} ")))[1] for i in range(4)]
        time.sleep(TIMEOUT_S + 0.5)  # P's first save meets its deadline while the store still hangs
    finally:
        mount.resume()
    resumed = time.monotonic()

    assert hit == plain[stored]  # recomputed, not served from a load that never came
    assert hit_s <= TIMEOUT_S + normal_d + 1.0, (hit_s, normal_d)
    loads = [x for x in markers.kv_loads(c.d.log()) if x.key == stored_key]
    assert loads and loads[-1].outcome == "NONE" and REASON in loads[-1].reason, loads
    for prompt, (out, _) in zip(during, misses_d):
        assert out == plain[prompt]
    assert all(s < TIMEOUT_S for _, s in misses_d), misses_d  # none waited for the store
    assert all(s < TIMEOUT_S for s in misses_p), misses_p
    dropped = [line for line in c.p.log().splitlines() if "KV send DROPPED." in line]
    assert dropped and all(REASON in line for line in dropped), c.p.log()[-3000:]

    # After SIGCONT: the stuck calls return and the store is used again.
    after = prompt_of(30, "after the stall ")
    deadline, load = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        tokens = c.prefill(after)
        sends = [s for s in markers.kv_sends(c.p.log()) if s.tokens == len(tokens)]
        out = c.chat(c.d, after)
        done = [x for x in markers.kv_loads(c.d.log()) if x.prompt_tokens == len(tokens) and x.outcome == "DONE"]
        if sends and done:
            load = done[-1]
            break
        after += " again"
        time.sleep(0.5)
    assert load is not None, c.d.log()[-3000:]
    assert out == c.chat(c.p, after)
    recovered_s = time.monotonic() - resumed

    threads_after = {}
    for _ in range(50):  # the pools' threads are back from the kernel; nothing else was started
        threads_after = {s.name: threads_of(s) for s in (c.p, c.d)}
        if all(threads_after[n] <= threads_before[n] for n in threads_before):
            break
        time.sleep(0.2)
    assert all(threads_after[n] <= threads_before[n] for n in threads_before), (threads_before, threads_after)

    figures = {
        "deadline_ms": TIMEOUT_MS,
        "d_normal_s": round(normal_d, 3), "p_normal_s": round(normal_p, 3),
        "d_hit_on_stalled_store_s": round(hit_s, 3),
        "d_misses_during_stall_s": [round(s, 3) for _, s in misses_d],
        "p_requests_during_stall_s": [round(s, 3) for s in misses_p],
        "longest_wait_on_store_s": round(max([hit_s] + [s for _, s in misses_d] + misses_p), 3),
        "stall_s": round(resumed - stall_begin, 3),
        "p_saves_dropped": len(dropped),
        "store_used_again_after_s": round(recovered_s, 3),
        "threads_before": threads_before, "threads_after": threads_after,
    }
    print("hung-store figures: " + json.dumps(figures))
