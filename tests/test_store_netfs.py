"""The store across hosts on a real network filesystem: sshfs over a loopback sshd (tests/sshfs.py).

P's side is the exported directory (a local disk, as on the prefill host); D's
side is that directory mounted through sshfs, as a decode host would mount it.
Real files, the real store code on both sides, no vLLM:

- P writes, D reads through the mount; and the reverse;
- a publish is atomic through the mount (D sees a whole entry or none, never
  a temp file or a mix of two versions), with concurrent writers on both sides;
- eviction from the other side and a replaced entry while D holds it open:
  D's open read finishes with one whole version or fails cleanly;
- a negative lookup cache on D's mount hides a new entry after a miss (what
  verify explains), and the options the docs recommend do not;
- the visibility lag (P publishes -> D sees it), p50/p99 per mount options,
  printed (and written to $KVCTL_NETFS_LAG_JSON when set); never asserted.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from sshfs import DEFAULT_OPTIONS, NEGATIVE_CACHE_OPTIONS, RECOMMENDED_OPTIONS, ensure_sshd, sshfs_mount

from connectors.store import auth, format as fmt
from connectors.store.fs_store import FSStore

IDENT = fmt.KVIdentity(model="m", num_layers=2, kv_parts=2, kv_heads=2, head_size=32, dtype="F32")
KEYS = auth.StoreKeys.from_secrets(["netfs-test-key"])


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    state = tmp_path_factory.mktemp("sshfs-state")
    port = ensure_sshd(state)
    yield state, port
    import subprocess
    from sshfs import SCRIPT
    subprocess.run(["bash", str(SCRIPT), "--stop", str(state)], check=False, capture_output=True)


@pytest.fixture
def sides(sshd, tmp_path):
    """(P's directory, D's mount of it) with sshfs's default options."""
    state, port = sshd
    export = tmp_path / "export"
    export.mkdir()
    with sshfs_mount(state, port, export, tmp_path / "mnt", DEFAULT_OPTIONS) as mnt:
        yield export, mnt


def entry(tokens: int = 40, seed: int = 0, value: float | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = torch.randn(2, 2, tokens, 2, 32, generator=g) if value is None else torch.full((2, 2, tokens, 2, 32), value)
    return ids, kv, torch.randn(1, 64, generator=g)


def test_p_writes_d_reads_through_the_mount_and_the_reverse(sides):
    export, mnt = sides
    ids, kv, hidden = entry()
    FSStore(export, keys=KEYS).save(IDENT, ids, kv, hidden)
    got = FSStore(mnt, keys=KEYS).load(IDENT, ids)
    assert torch.equal(got.kv, kv)
    written = []
    FSStore(mnt, keys=KEYS).load_into(IDENT, ids, lambda layer, t: written.append(t.clone()))
    assert torch.equal(torch.stack(written), kv)
    assert fmt.verify_entry(fmt.entry_path(mnt, got.key), KEYS)
    ids2, kv2, hidden2 = entry(tokens=33, seed=1)
    ids2 = ids2[:33]
    saved = FSStore(mnt, keys=KEYS).save(IDENT, ids2, kv2, hidden2)  # a writer on the mounted side
    assert torch.equal(FSStore(export, keys=KEYS).load(IDENT, ids2).kv, kv2)
    assert sorted(p.name for p in export.iterdir()) == sorted([f"{got.key}.safetensors", saved.path.name])


def _publisher(root: str, rounds: int, values: tuple[float, ...], stop_after: float) -> None:
    store = FSStore(root, fsync=False)
    ids, _, hidden = entry()
    end = time.monotonic() + stop_after
    for i in range(rounds):
        store.save(IDENT, ids, entry(value=values[i % len(values)])[1], hidden)
        if time.monotonic() > end:
            break


def test_publish_is_atomic_through_the_mount_with_writers_on_both_sides(sides):
    """Writers on P's side and on the mounted side republish one key with two contents; a reader
    on the mount sees one whole version each time (or a miss before the first), never a mix,
    never a temp file as an entry, never an invalid entry."""
    export, mnt = sides
    ids = entry()[0]
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_publisher, args=(str(root), 200, values, 20.0))
               for root, values in ((export, (1.0, 2.0)), (mnt, (2.0, 1.0)), (mnt, (1.0, 2.0)))]
    for w in writers:
        w.start()
    reader, seen = FSStore(mnt), set()
    try:
        while any(w.is_alive() for w in writers):
            try:
                got = reader.load(IDENT, ids)
            except FileNotFoundError:
                continue
            values = set(got.kv.unique().tolist())
            assert values in ({1.0}, {2.0}), values  # one whole version
            seen |= values
            for name in os.listdir(mnt):
                assert fmt.is_entry_name(name) or fmt.is_temp_name(name), name
    finally:
        for w in writers:
            w.join(60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    assert seen
    assert [n for n in os.listdir(export) if not fmt.is_entry_name(n)] == []  # no temp file left
    assert fmt.verify_entry(fmt.entry_path(export, fmt.compute_key(IDENT, ids)))


@pytest.mark.parametrize("change", ["evicted", "replaced"])
def test_entry_evicted_or_replaced_on_p_while_d_holds_it_open(sides, change):
    export, mnt = sides
    ids, kv, hidden = entry(tokens=400)
    p_store = FSStore(export)
    saved = p_store.save(IDENT, ids, kv, hidden)
    d_path = fmt.entry_path(mnt, saved.key)
    with fmt.open_entry(d_path) as (f, _):
        header = fmt.parse_header(d_path, f)
        if change == "evicted":
            [found] = [s for s in fmt.list_store(export) if s.kind is fmt.FileKind.ENTRY]
            assert fmt.remove_store_file(found)
        else:
            p_store.save(IDENT, ids, entry(tokens=400, value=7.0)[1], hidden)
        try:  # D's open read: the version it opened, whole, or a clean failure; never a mix
            data = fmt.read_data(d_path, f, header)
            kv_read = torch.frombuffer(bytearray(data[slice(*header.span("kv"))]),
                                       dtype=torch.float32).view(kv.shape)
            assert torch.equal(kv_read, kv)
        except (fmt.EntryCorrupt, OSError) as e:
            print(f"D's open read after the entry was {change}: {e}")
    if change == "evicted":
        with pytest.raises(FileNotFoundError):
            FSStore(mnt).load(IDENT, ids)
    else:
        assert set(FSStore(mnt).load(IDENT, ids).kv.unique().tolist()) == {7.0}


def _publish_then_lookups(export: Path, mnt: Path, n: int, prior_miss: bool) -> list[float]:
    """For each of `n` new entries: (a miss through the mount first,) publish on P's side, then
    poll the mount until the entry opens; returns the lags in ms."""
    store, lags = FSStore(export, fsync=False), []
    for i in range(n):
        ids, kv, hidden = entry(tokens=8, seed=i)
        ids = [(i + 1000 * prior_miss) * 10 + t for t in range(8)]
        path = fmt.entry_path(mnt, fmt.compute_key(IDENT, ids))
        if prior_miss:
            assert not os.path.lexists(path)
        store.save(IDENT, ids, kv[:, :, :8], hidden)
        start = time.perf_counter()
        while not os.path.lexists(path):
            if time.perf_counter() - start > 60:
                raise AssertionError(f"{path.name} not visible through the mount after 60 s")
            time.sleep(0.001)
        lags.append((time.perf_counter() - start) * 1e3)
    return lags


def test_a_negative_lookup_cache_hides_a_new_entry_the_recommended_options_do_not(sshd, tmp_path):
    state, port = sshd
    export = tmp_path / "export"
    export.mkdir()
    ids, kv, hidden = entry()
    key = fmt.compute_key(IDENT, ids)
    with sshfs_mount(state, port, export, tmp_path / "cached", NEGATIVE_CACHE_OPTIONS) as cached, \
            sshfs_mount(state, port, export, tmp_path / "fresh", RECOMMENDED_OPTIONS) as fresh:
        for mnt in (cached, fresh):
            with pytest.raises(FileNotFoundError):  # D looked before P published: a miss
                FSStore(mnt).load(IDENT, ids)
        FSStore(export).save(IDENT, ids, kv, hidden)
        assert fmt.entry_path(export, key).exists()
        with pytest.raises(FileNotFoundError):  # P's side has it; D's cached lookup says no
            FSStore(cached).load(IDENT, ids)
        assert torch.equal(FSStore(fresh).load(IDENT, ids).kv, kv)


def test_visibility_lag_per_mount_options(sshd, tmp_path):
    """P publishes -> D sees: p50/p99 over fresh entries, with and without a miss just before."""
    state, port = sshd
    results = {}
    for label, options in (("default", DEFAULT_OPTIONS), ("recommended", RECOMMENDED_OPTIONS),
                           ("negative_timeout=3", NEGATIVE_CACHE_OPTIONS)):
        export = tmp_path / f"export-{len(results)}"
        export.mkdir()
        with sshfs_mount(state, port, export, tmp_path / f"mnt-{len(results)}", options) as mnt:
            for prior_miss in (False, True):
                n = 5 if "negative" in label and prior_miss else 40
                lags = sorted(_publish_then_lookups(export, mnt, n, prior_miss))
                results[f"{label}{' after a miss' if prior_miss else ''}"] = {
                    "n": n, "p50_ms": round(lags[len(lags) // 2], 1),
                    "p99_ms": round(lags[min(n - 1, int(n * 0.99))], 1), "max_ms": round(lags[-1], 1)}
    print(json.dumps(results, indent=1))
    if os.environ.get("KVCTL_NETFS_LAG_JSON"):
        Path(os.environ["KVCTL_NETFS_LAG_JSON"]).write_text(json.dumps(results, indent=1) + "\n")
    assert all(r["n"] for r in results.values())


def test_verify_explains_a_miss_the_store_holds(tmp_path):
    """D logged a miss for an entry that is in the store (P's side) and was published before D was
    asked: verify's evidence names the mount's caching and the fix. Pure: log text and a real entry."""
    from connectors import log_lines
    from kvctl.verify.checks import check_decode_skipped_forward, explain_unseen_entry

    ids, kv, hidden = entry()
    saved = FSStore(tmp_path).save(IDENT, ids, kv, hidden)
    created = fmt.parse_header(saved.path).created
    miss = log_lines.REDO_FORWARD % (0, f"miss key={saved.key} tokens={len(ids)}")
    assert not check_decode_skipped_forward(miss, saved.key).passed
    why = explain_unseen_entry(tmp_path, saved.key, miss, created + 0.25)
    assert f"the entry exists on P's side ({saved.path}, published 250 ms before D was asked)" in why
    assert "did not see it within 250 ms" in why and "negative_timeout=0" in why and "lookupcache" in why
    v1_miss = log_lines.KV_LOAD_NONE % (0, "r1", saved.key, len(ids), len(ids), 0, "miss")
    assert explain_unseen_entry(tmp_path, saved.key, v1_miss, created + 1, "answered")
    # Not a lagging view: published after D was asked, another reason, or no entry at all.
    assert explain_unseen_entry(tmp_path, saved.key, miss, created - 1) == ""
    corrupt = log_lines.REDO_FORWARD % (0, f"corrupt key={saved.key}: checksum mismatch")
    assert explain_unseen_entry(tmp_path, saved.key, corrupt, created + 1) == ""
    saved.path.unlink()
    assert explain_unseen_entry(tmp_path, saved.key, miss, created + 1) == ""


def test_doctor_store_on_a_local_disk_and_on_the_network_mount(sshd, tmp_path, capsys):
    from kvctl.store.doctor import doctor_store

    local = doctor_store(tmp_path)
    assert local.passed and [c.name for c in local.checks] == [
        "o_excl", "fsync", "atomic_rename", "free_space", "permissions", "mount_caching"]
    assert not any(c.warning for c in local.checks)
    assert sorted(os.listdir(tmp_path)) == []  # its probe files are gone
    state, port = sshd
    export = tmp_path / "export"
    export.mkdir()
    for options, warned in ((RECOMMENDED_OPTIONS, False), (NEGATIVE_CACHE_OPTIONS, True)):
        with sshfs_mount(state, port, export, tmp_path / "mnt", options) as mnt:
            remote = doctor_store(mnt)
            assert remote.filesystem == "fuse.sshfs" and remote.passed, remote.to_json()
            caching = next(c for c in remote.checks if c.name == "mount_caching")
            assert caching.warning is warned, caching
            if warned:
                assert "negative_timeout=0" in caching.detail
    too_full = doctor_store(tmp_path, min_free=1 << 60)
    assert not too_full.passed and "bound the store" in next(c for c in too_full.checks
                                                              if c.name == "free_space").detail


def test_doctor_store_cli_exit_codes(kvctl, tmp_path):
    ok = kvctl("doctor", "store", str(tmp_path), "--json")
    assert ok.rc == 0 and json.loads(ok.stdout)["passed"] is True
    full = kvctl("doctor", "store", str(tmp_path), "--min-free-gb", "1e12", "--json")
    assert full.rc == 1 and json.loads(full.stdout)["passed"] is False
    missing = kvctl("doctor", "store", str(tmp_path / "nope"))
    assert missing.rc == 2 and "is not a directory" in missing.stderr
