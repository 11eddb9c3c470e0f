"""A bounded store under a real P/D pair: eviction races, load, and `kvctl store prune`.

One cluster for the module (starting one costs ~40-60 s here): P's FSConnector
has `max_bytes` = 5 MB, room for three ~1.35 MB entries of the eviction
prompts (or ~60 of the short load prompts). A sampler thread holding the
store's lock (connectors.store.eviction.store_lock, the one producers publish under)
measures the published bytes throughout each test: the bound must never be
exceeded, not even by one entry.

- eviction: 15 long prompts. Rounds of five go P, P, P, P, P then D x5, so
  the first ones are evicted before D reads them: D must recompute (miss)
  exactly for the entries that were gone and skip for the others. Then P
  republishes while D reads concurrently: eviction races reads; D never logs
  a reader error, only hits or misses, and every output equals its baseline.
- load: `kvctl verify --concurrency 8 --requests 100` against the cluster:
  0 mismatches, 0 errors, every check passed (a bounded store under load).
- prune: `kvctl store prune --name` on the live cluster empties the store
  under the lock; D then recomputes and still answers correctly.

The tests do not depend on each other's order or leftovers: every
expectation is derived from what the store holds at the moment it matters.
The pure parts (prompt generation, load summary, prune options) have fast
tests at the end that need no cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import Kvctl
from e2e_helpers import cluster_for_module, redo_lines_for, skip_line_for

from connectors.store import format as fmt
from connectors.store.eviction import published_entries, store_lock
from kvctl.verify import markers
from kvctl.client import user_messages
from kvctl.verify.load_mode import ERROR_CHECK, generate_prompts, percentile, summarise
from kvctl.verify.checks import CheckResult, transfer_bytes
from kvctl.verify.report import RequestReport, VerifyReport

pytestmark = pytest.mark.xdist_group("vllm")
e2e = pytest.mark.e2e

MAX_BYTES = 5_000_000
SENTENCE = "An evicted entry is a miss and the decode server computes the prompt again. "
REPEAT = 35  # ~1300 tokens: ~1.35 MB per entry, three fit under MAX_BYTES
NUM_PROMPTS = 15
ROUND = 5
DECODE_TOKENS = 12
LOAD_REQUESTS = 100
LOAD_CONCURRENCY = 8


def published_bytes(root: Path) -> int:
    return sum(size for _, size, _ in published_entries(root))


class BoundSampler:
    """Samples the store's published bytes under the producers' lock, in a thread."""

    def __init__(self, root: Path, interval_s: float = 0.01):
        self.root, self.interval_s = root, interval_s
        self.max_bytes = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with store_lock(self.root):
                self.max_bytes = max(self.max_bytes, published_bytes(self.root))
            self.samples += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> "BoundSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    store = tmp_path_factory.mktemp("bounded") / "store"
    store.mkdir()
    prefill = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
               "kv_connector_extra_config": {"fs_storage_path": str(store), "max_bytes": MAX_BYTES}}
    with cluster_for_module(tmp_path_factory, shared_dir, rig_python, tiny_model, "bounded",
                            store=store, prefill_config=prefill) as c:
        yield c


def d_text_since(cluster, offset: int) -> str:
    return cluster.log("decode")[offset:]


@e2e
def test_eviction_bound_held_and_d_recomputes_only_evicted(cluster):
    store = cluster.store
    prompts = [user_messages(f"Eviction test {i}: " + SENTENCE * REPEAT) for i in range(NUM_PROMPTS)]
    with BoundSampler(store) as sampler:
        # Baselines first (P publishes, and evicts, as it generates them).
        baselines = [cluster.p.chat(m, max_tokens=DECODE_TOKENS).token_ids for m in prompts]
        tokens = [cluster.p.tokenize_chat(m) for m in prompts]
        ident = fmt.scan_store(store).entries[0].identity
        keys = [fmt.compute_key(ident, t) for t in tokens]
        assert len(set(keys)) == NUM_PROMPTS

        # Rounds: five P, then five D. Whether D hits is decided by the store at that moment.
        d_start = len(cluster.log("decode"))
        evicted, present = [], []
        for first in range(0, NUM_PROMPTS, ROUND):
            group = range(first, first + ROUND)
            for i in group:
                cluster.p.chat(prompts[i], max_tokens=1)
            for i in group:
                with store_lock(store):  # no publish can slip in: P is idle, D never publishes
                    there = fmt.entry_path(store, keys[i]).exists()
                (present if there else evicted).append(i)
                dec = cluster.d.chat(prompts[i], max_tokens=DECODE_TOKENS)
                assert dec.token_ids == baselines[i], f"prompt {i}: {dec.text!r}"
        text = cluster.wait_for("decode", lambda t: all(skip_line_for(t[d_start:], keys[i])
                                                         or redo_lines_for(t[d_start:], keys[i])
                                                         for i in range(NUM_PROMPTS)) and t[d_start:])
        assert text, "D logged no skip/redo line for some prompt"
        for i in present:
            assert skip_line_for(text, keys[i]) and not redo_lines_for(text, keys[i]), f"prompt {i}"
        for i in evicted:
            redo = redo_lines_for(text, keys[i])
            assert redo and redo[0].reason.startswith("miss"), (i, redo)
            assert not skip_line_for(text, keys[i])
        assert evicted and present, (evicted, present)

        # Race: P republishes (evicting) while D reads the same prompts.
        race_start = len(cluster.log("decode"))

        def produce() -> None:
            for m in prompts:
                cluster.p.chat(m, max_tokens=1)

        def consume() -> list:
            out = []
            for m in prompts:
                out.append(cluster.d.chat(m, max_tokens=DECODE_TOKENS).token_ids)
            return out

        with ThreadPoolExecutor(2) as pool:
            p_done = pool.submit(produce)
            raced = pool.submit(consume).result()
            p_done.result()
        assert raced == baselines
        race_text = cluster.wait_for("decode", lambda t: all(
            skip_line_for(t[race_start:], k) or redo_lines_for(t[race_start:], k) for k in keys) and t[race_start:])
        assert race_text
        reasons = [r.reason for r in markers.redo_forwards(race_text)]
        assert all(r.startswith("miss") for r in reasons), reasons

    d_log = cluster.log("decode")
    assert "unexpected error loading" not in d_log
    assert not [r for r in markers.redo_forwards(d_log[d_start:]) if not r.reason.startswith("miss")]
    print(f"eviction: bound {MAX_BYTES}, max observed {sampler.max_bytes} over {sampler.samples} samples; "
          f"round-robin D: {len(present)} hits, {len(evicted)} evicted -> recomputed")
    assert sampler.samples > 20
    assert sampler.max_bytes <= MAX_BYTES, f"store reached {sampler.max_bytes} bytes, bound {MAX_BYTES}"
    assert sampler.max_bytes > MAX_BYTES // 2  # the store really was filled


@e2e
def test_load_8_clients_100_prompts_all_checks_pass(cluster):
    run = Kvctl(Path(os.environ["KVCTL_HOME"]))
    with BoundSampler(cluster.store) as sampler:
        res = run("verify", "--name", cluster.state.name, "--concurrency", str(LOAD_CONCURRENCY),
                  "--requests", str(LOAD_REQUESTS), "--max-tokens", "8", "--json", timeout=900)
    assert res.rc == 0, res
    report = json.loads(res.stdout)
    load = report["load"]
    print("load:", json.dumps({k: v for k, v in load.items() if k not in ("mismatches", "errors")}))
    assert report["passed"] and load["requests"] == LOAD_REQUESTS and load["concurrency"] == LOAD_CONCURRENCY
    assert load["num_mismatches"] == 0 and load["num_errors"] == 0 and load["failed_checks"] == {}
    assert len(report["requests"]) == LOAD_REQUESTS
    assert len({r["key"] for r in report["requests"]}) == LOAD_REQUESTS  # distinct prompts, distinct entries
    assert all(r["passed"] for r in report["requests"])
    assert load["completed"] == LOAD_REQUESTS and load["throughput_rps"] > 0
    assert 0 < load["prefill_latency_s"]["p50"] <= load["prefill_latency_s"]["p99"]
    assert 0 < load["decode_latency_s"]["p50"] <= load["decode_latency_s"]["p99"]
    # Each request moved exactly its own entry's data (batched D steps are not counted twice).
    header = fmt.scan_store(cluster.store).entries[0]
    per_token = sum(header.span(n)[1] - header.span(n)[0] for n in ("token_ids", "kv")) // header.num_tokens
    hidden = header.span("hidden")[1] - header.span("hidden")[0]
    assert load["transfer_bytes"] == sum(r["prompt_tokens"] * per_token + hidden for r in report["requests"])
    assert [r["transfer_bytes"] for r in report["requests"]] == [r["prompt_tokens"] * per_token + hidden
                                                                 for r in report["requests"]]
    assert sampler.max_bytes <= MAX_BYTES, f"store reached {sampler.max_bytes} bytes, bound {MAX_BYTES}"


@e2e
def test_prune_live_store_then_d_recomputes(cluster):
    run = Kvctl(Path(os.environ["KVCTL_HOME"]))
    messages = user_messages("A prompt whose entry an operator prunes before decode reads it.")
    baseline = cluster.p.chat(messages, max_tokens=DECODE_TOKENS).token_ids
    assert published_entries(cluster.store)
    res = run("store", "prune", "--name", cluster.state.name, "--max-bytes", "0", "--json")
    assert res.rc == 0, res
    pruned = json.loads(res.stdout)
    assert pruned["num_removed"] >= 1 and pruned["total_bytes"] == 0
    assert published_entries(cluster.store) == []
    d_start = len(cluster.log("decode"))
    assert cluster.d.chat(messages, max_tokens=DECODE_TOKENS).token_ids == baseline
    redo = cluster.wait_for("decode", lambda t: [r for r in markers.redo_forwards(t[d_start:])
                                                 if r.reason.startswith("miss")])
    assert redo


# -- no cluster needed --

def test_prune_by_age_and_size_on_a_real_store(tmp_path, kvctl):
    root = tmp_path / "store"
    root.mkdir()
    ident = fmt.KVIdentity(model="m", num_layers=1, kv_parts=2, kv_heads=1, head_size=32, dtype="F32")
    paths = []
    for n, age in ((10, 400), (20, 300), (30, 200), (40, 100)):
        blobs = {"token_ids": fmt.TensorBlob("I64", (n,), fmt.token_bytes(range(n))),
                 "kv": fmt.TensorBlob("F32", (1, 2, n, 1, 32), bytes(2 * n * 32 * 4)),
                 "hidden": fmt.TensorBlob("F32", (1, 8), bytes(32))}
        path = fmt.write_entry(root, fmt.compute_key(ident, range(n)), ident, blobs, fsync=False)
        t = time.time() - age
        os.utime(path, (t, t))
        paths.append(path)
    sizes = [p.stat().st_size for p in paths]
    res = kvctl("store", "prune", str(root), "--older-than", "250", "--json")
    assert res.rc == 0, res
    out = json.loads(res.stdout)
    assert sorted(out["removed"]) == sorted(p.name for p in paths[:2])
    assert out["freed_bytes"] == sum(sizes[:2]) and out["total_bytes"] == sum(sizes[2:])
    keep = paths[3].stat().st_size
    res = kvctl("store", "prune", str(root), "--max-bytes", str(keep))
    assert res.rc == 0 and "removed 1 entry" in res.stdout, res
    assert [p.exists() for p in paths] == [False, False, False, True]
    assert kvctl("store", "check", str(root)).rc == 0


@pytest.mark.parametrize("args", [(), ("--max-bytes", "-1"), ("--older-than", "soon")])
def test_prune_bad_input_exits_2(tmp_path, kvctl, args):
    res = kvctl("store", "prune", str(tmp_path), *args)
    assert res.rc == 2, res
    assert "Traceback" not in res.stderr
    if not args:
        assert "--max-bytes" in res.stderr and "--older-than" in res.stderr


def test_generated_prompts_are_distinct_and_stable():
    prompts = generate_prompts(LOAD_REQUESTS)
    assert len(set(prompts)) == LOAD_REQUESTS and prompts == generate_prompts(LOAD_REQUESTS)
    assert generate_prompts(3) == prompts[:3]


def test_load_summary_counts_mismatches_errors_and_percentiles():
    def req(i, match=True, error=False):
        if error:
            return RequestReport(prompt=f"p{i}", prompt_tokens=0, key="",
                                 checks=[CheckResult(ERROR_CHECK, False, "decode unreachable")])
        return RequestReport(prompt=f"p{i}", prompt_tokens=10, key=f"k{i}",
                             checks=[CheckResult("output_matches_baseline", match, "diff at 3")],
                             prefill_latency_s=0.1 * (i + 1), decode_latency_s=0.2 * (i + 1),
                             transfer_bytes=1000)
    report = VerifyReport("c", [req(i) for i in range(8)] + [req(8, match=False), req(9, error=True)], 8)
    stats = summarise(report, concurrency=4, wall_s=2.0).to_json()
    assert stats["requests"] == 10 and stats["completed"] == 9
    assert stats["num_mismatches"] == 1 and stats["mismatches"][0]["request"] == 8
    assert stats["num_errors"] == 1 and stats["errors"][0]["evidence"] == "decode unreachable"
    assert stats["failed_checks"] == {"output_matches_baseline": 1, ERROR_CHECK: 1}
    assert stats["transfer_bytes"] == 9000 and stats["throughput_rps"] == 4.5
    assert stats["prefill_latency_s"]["p50"] == pytest.approx(0.5)
    assert stats["decode_latency_s"]["p99"] == pytest.approx(1.8)
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0


def test_transfer_bytes_of_a_batched_skip_line_is_the_entrys_own(tmp_path):
    """D's skip line sums a whole batch; a request is charged only its own entry."""
    ident = fmt.KVIdentity(model="m", num_layers=1, kv_parts=2, kv_heads=1, head_size=32, dtype="F32")
    blobs = {"token_ids": fmt.TensorBlob("I64", (4,), fmt.token_bytes(range(4))),
             "kv": fmt.TensorBlob("F32", (1, 2, 4, 1, 32), bytes(2 * 4 * 32 * 4)),
             "hidden": fmt.TensorBlob("F32", (1, 8), bytes(32))}
    key = fmt.compute_key(ident, range(4))
    fmt.write_entry(tmp_path, key, ident, blobs, fsync=False)
    own = 4 * 8 + 2 * 4 * 32 * 4 + 32
    skip = markers.SkipForwardLine(0, (key, "f" * 32), 9, 5 * own, 0.1, "")
    send_again = markers.KVSendLine(0, key, 4, 0, 0.0, "")  # "already stored": bytes=0
    assert transfer_bytes(skip, send_again, tmp_path, key) == own
    assert transfer_bytes(skip, markers.KVSendLine(0, key, 4, own, 1.0, ""), tmp_path, key) == own
    alone = markers.SkipForwardLine(0, (key,), 4, own, 0.1, "")
    assert transfer_bytes(alone, None, tmp_path, key) == own
    assert transfer_bytes(skip, send_again, tmp_path, "0" * 32) is None  # evicted: unknown, not 5x
