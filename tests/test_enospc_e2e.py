"""Disk full under a real P/D pair: the shared store is a 4 MiB tmpfs that fills up.

Each prompt (~740 KB of KV) goes P (max_tokens=1) -> D (12 tokens) -> baseline
(P, 12 tokens). Once the tmpfs is full, P's publishes fail with ENOSPC:
- P keeps answering every request;
- P logs `KV send FAILED` once per burst, not once per request (counted);
- nothing partial is published: no temp file is left, every entry validates;
- D recomputes the prompts whose entries could not be stored (redo, reason
  miss) and skips the forward for the ones that were;
- D's output equals the baseline for every prompt.

The test mounts the tmpfs itself (we run as root) and always unmounts it. If
mounting is not permitted it fails under CI=true and is skipped elsewhere.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from e2e_helpers import cluster_for_module, redo_lines_for, skip_line_for
from tmpfs import mounted_tmpfs

from connectors.store import format as fmt
from kvctl.verify import markers
from kvctl.client import user_messages

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

TMPFS_SIZE = "4m"
SENTENCE = "The disk fills up slowly while the prefill server keeps writing its cache. "
REPEAT = 27  # ~715 tokens: ~740 KB per entry, five fit in 4 MiB
MAX_PROMPTS = 14
FAILED_PROMPTS_WANTED = 4  # keep sending until this many prompts could not be stored
FAILED_LINE = "KV send FAILED"
FAILURE_LOG_INTERVAL_S = 30.0  # FSConnector's burst window (connectors.logs)


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> Path:
    """A size-limited tmpfs, unmounted at module end whatever happened."""
    with mounted_tmpfs(tmp_path_factory.mktemp("enospc") / "store", TMPFS_SIZE) as mnt:
        yield mnt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model, full_disk):
    with cluster_for_module(tmp_path_factory, shared_dir, rig_python, tiny_model, "enospc",
                            store=full_disk) as c:
        yield c


def failed_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if FAILED_LINE in line]


def test_full_disk_p_serves_d_recomputes_outputs_match(cluster):
    store = cluster.store
    stored, not_stored = [], []
    ident = None
    first_failure_at = last_failure_at = None
    for i in range(MAX_PROMPTS):
        if len(not_stored) >= FAILED_PROMPTS_WANTED:
            break
        messages = user_messages(f"Disk test {i}: " + SENTENCE * REPEAT)
        tokens = cluster.p.tokenize_chat(messages)
        p_res = cluster.p.chat(messages, max_tokens=1)  # raises if P stops answering
        assert p_res.token_ids and len(p_res.token_ids) == 1
        if ident is None:  # P's KV identity, from the first entry it published
            assert fmt.scan_store(store).entries, "P could not publish even the first entry"
            ident = fmt.scan_store(store).entries[0].identity
        key = fmt.compute_key(ident, tokens)
        # P's send runs inside the step that produced the answer: the entry is there or never will be.
        if fmt.entry_path(store, key).exists():
            assert cluster.wait_for("prefill", lambda t, k=key: [s for s in markers.kv_sends(t) if s.key == k])
            stored.append((messages, key))
        else:
            not_stored.append((messages, key))
            last_failure_at = time.monotonic()
            first_failure_at = first_failure_at or last_failure_at

    assert len(stored) >= 3, f"only {len(stored)} prompts fit in the {TMPFS_SIZE} store"
    assert len(not_stored) >= FAILED_PROMPTS_WANTED, "the store never filled up"

    # D: skip for stored entries, recompute (miss) for the rest; every output equals the baseline.
    for messages, key in stored + not_stored:
        dec = cluster.d.chat(messages, max_tokens=12)
        base = cluster.p.chat(messages, max_tokens=12)  # P answers while the disk stays full
        assert dec.token_ids and dec.token_ids == base.token_ids, (key, dec.text, base.text)
    d_log = cluster.wait_for("decode", lambda t: all(skip_line_for(t, k) or redo_lines_for(t, k)
                                                      for _, k in stored + not_stored) and t)
    assert d_log, "D did not log a skip or redo line for every prompt"
    for _, key in stored:
        assert skip_line_for(d_log, key) and not redo_lines_for(d_log, key), key
    for _, key in not_stored:
        redo = redo_lines_for(d_log, key)
        assert redo and redo[0].reason.startswith("miss"), (key, redo)
        assert not skip_line_for(d_log, key)
    last_failure_at = time.monotonic()  # the baselines of unstored prompts failed to publish too

    # Failures are logged once per burst, not per request.
    lines = cluster.wait_for("prefill", failed_lines)
    assert lines, "P never logged KV send FAILED"
    assert "No space left on device" in lines[0] and "serving continues" in lines[0], lines[0]
    attempts = 2 * len(not_stored)  # P max_tokens=1 and the baseline, each a failed publish
    bursts = 1 + int((last_failure_at - first_failure_at) // FAILURE_LOG_INTERVAL_S)
    assert len(lines) <= bursts < attempts, (lines, attempts)
    suppressed = sum(int(m) for line in lines for m in re.findall(r"; (\d+) similar failures not logged", line))
    assert suppressed <= attempts - len(lines)
    print(f"enospc: {len(stored)} prompts stored, {len(not_stored)} not ({attempts} failed publishes), "
          f"{len(lines)} KV send FAILED line(s)")

    # Nothing partial is visible: no temp file, every entry whole and valid.
    scan = fmt.scan_store(store)
    assert scan.temp_files == [] and scan.corrupt == [] and scan.foreign == []
    names = set()
    for header in scan.entries:
        fmt.read_entry(header.path)
        names.add(header.path.name)
    assert names == {fmt.entry_path(store, k).name for _, k in stored}

