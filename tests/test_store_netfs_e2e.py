"""P and D across a real network mount (sshfs over a loopback sshd): P's store is its own
directory, D's fs_storage_path is that directory mounted through sshfs, as on two hosts.

One keyed cluster for the module (V0). kvctl verify passes across the mount (P's send, the
entry on P's side, D's skip through the mount, D's output equal to the baseline). D's mount
caches negative lookups (negative_timeout=3, as NFS's default lookupcache=all does): after
D has missed a prompt, P's entry for it stays invisible to D for seconds, D recomputes, and
verify's failure explains it: the entry exists on P's side, D did not see it, the mount's
caching, and the fix.
"""

from __future__ import annotations

import dataclasses
import fcntl
from pathlib import Path

import pytest
from e2e_helpers import Cluster, slot_lock_path
from sshfs import NEGATIVE_CACHE_OPTIONS, SCRIPT, ensure_sshd, sshfs_mount

from kvctl.client import user_messages
from kvctl.verify.verifier import verify_cluster

pytestmark = pytest.mark.xdist_group("vllm")
e2e = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    import subprocess

    from kvctl.cluster.lifecycle import running_cluster
    from kvctl.cluster.spec import build_1p1d_spec

    state_dir = tmp_path_factory.mktemp("netfs-sshd")
    port = ensure_sshd(state_dir)
    base = tmp_path_factory.mktemp("netfs")
    export, home = base / "p-store", base / "home"
    export.mkdir()
    try:
        with sshfs_mount(state_dir, port, export, base / "d-mount", NEGATIVE_CACHE_OPTIONS) as mount, \
                open(slot_lock_path(shared_dir), "w") as lock, pytest.MonkeyPatch.context() as mp:
            fcntl.flock(lock, fcntl.LOCK_EX)
            mp.setenv("KVCTL_HOME", str(home))
            mp.setenv("KVCTL_RIG_PYTHON", str(rig_python))
            spec = build_1p1d_spec(name="netfs", model=tiny_model, store=export, store_keys=("netfs-e2e-key",))
            decode = dict(spec.decode.kv_transfer_config)
            decode["kv_connector_extra_config"] = {**decode["kv_connector_extra_config"],
                                                   "fs_storage_path": str(mount)}
            spec = dataclasses.replace(spec, decode=dataclasses.replace(spec.decode, kv_transfer_config=decode))
            with running_cluster(spec) as state:
                c = Cluster(state)
                try:
                    yield c, mount
                finally:
                    c.close()
    finally:
        subprocess.run(["bash", str(SCRIPT), "--stop", str(state_dir)], check=False, capture_output=True)


@e2e
def test_verify_passes_with_d_reading_through_the_mount(cluster):
    c, mount = cluster
    assert c.state.instances["decode"].kv_transfer_config["kv_connector_extra_config"]["fs_storage_path"] == str(mount)
    report = verify_cluster(c.state, ["P writes its own disk; D reads it through sshfs."], max_tokens=12)
    assert report.passed, [(ch.name, ch.evidence) for r in report.requests for ch in r.checks]
    [req] = report.requests
    assert Path(mount, f"{req.key}.safetensors").exists() and Path(c.store, f"{req.key}.safetensors").exists()


@e2e
def test_a_miss_hidden_by_the_mounts_lookup_cache_is_explained(cluster):
    c, _ = cluster
    prompt = "D asked first, missed, and its mount kept the miss."
    c.d.chat(user_messages(prompt), max_tokens=2)  # D misses: its mount caches the negative lookup
    report = verify_cluster(c.state, [prompt], max_tokens=12)
    [req] = report.requests
    checks = {ch.name: ch for ch in req.checks}
    assert checks["store_entry_written"].passed and checks["output_matches_baseline"].passed
    skip = checks["decode_skipped_forward"]
    assert not skip.passed
    assert "the entry exists on P's side" in skip.evidence and "did not see it within" in skip.evidence, skip
    assert "negative_timeout=0" in skip.evidence and "lookupcache=positive" in skip.evidence
