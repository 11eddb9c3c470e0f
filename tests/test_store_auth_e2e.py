"""Authenticated entries under a real P/D pair (V0): D serves only what the cluster's key signed.

One keyed cluster for the module (store keys NEW, OLD: NEW signs, both are
accepted, as during a rotation). A forged entry (store_forgery.forge: KV
noise, a correct checksum, the header rewritten) is refused by D, which
recomputes, answers exactly the baseline and leaves the entry where it is;
an entry re-signed with OLD is served; one signed with a key the cluster
does not hold is refused. inspect-store with the cluster's key tells them apart.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from e2e_helpers import cluster_for_module, redo_lines_for, skip_line_for
from store_forgery import forge, resign

from connectors.store import auth, format as fmt
from kvctl.client import user_messages
from kvctl.cluster.state import cluster_dir, cluster_store_keys
from kvctl.store.inspect import inspect_store

pytestmark = pytest.mark.xdist_group("vllm")
e2e = pytest.mark.e2e

NEW, OLD, OTHER = "e2e-store-key-new", "e2e-store-key-old", "another-clusters-key"
TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    with cluster_for_module(tmp_path_factory, shared_dir, rig_python, tiny_model, "signed",
                            store_keys=(NEW, OLD)) as c:
        yield c


def d_redo_since(cluster, offset: int, key: str):
    found = cluster.wait_for("decode", lambda t: redo_lines_for(t[offset:], key))
    assert found, f"D logged no redo line for {key}"
    return found[-1]


@e2e
def test_keys_reach_the_servers_through_their_environment_only(cluster):
    new_id, old_id = auth.derive_key(NEW).key_id, auth.derive_key(OLD).key_id
    for role in ("prefill", "decode"):
        text = cluster.wait_for(role, lambda t: "FSConnector store keys:" in t and t)
        assert f"FSConnector store keys: signing with {new_id}; accepting {new_id}, {old_id}" in text
        assert NEW not in text and OLD not in text
        pid = cluster.state.instances[role].runtime_fields["pid"]
        assert NEW not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert Path(f"/proc/{pid}/environ").read_bytes().split(b"\0").count(
            f"{auth.KEY_ENV}={NEW},{OLD}".encode()) == 1
    key_file = cluster_dir("signed") / "store_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert cluster_store_keys("signed").key_ids == [new_id, old_id]
    assert cluster.state.store_signed


@e2e
def test_forged_entry_is_refused_and_d_answers_the_baseline(cluster):
    ex = cluster.exchange("A forged entry must never decide what the decode instance answers.",
                          max_tokens=TOKENS)
    assert ex.key and ex.decode_ids == ex.baseline_ids
    assert skip_line_for(cluster.log("decode"), ex.key)
    path = fmt.entry_path(cluster.store, ex.key)
    assert auth.signature_of(fmt.parse_header(path).metadata)[0] == auth.derive_key(NEW).key_id
    messages = user_messages(ex.prompt)
    for keep_tag, reason in ((True, "bad signature"), (False, "unsigned")):
        forge(path, keep_tag=keep_tag)
        forged = path.read_bytes()
        fmt.verify_entry(path)  # what a reader without the key sees: a valid entry
        offset = len(cluster.log("decode"))
        dec = cluster.d.chat(messages, max_tokens=TOKENS)
        assert dec.token_ids == ex.baseline_ids, dec.text
        redo = d_redo_since(cluster, offset, ex.key)
        assert redo.reason.startswith(f"refused key={ex.key}: {reason}"), redo.reason
        assert not skip_line_for(cluster.log("decode")[offset:], ex.key)
        assert path.read_bytes() == forged  # refused, not deleted: it may be another writer's
    # inspect-store with the cluster's key: the forged entry is unsigned, and `store check --fix` keeps it
    report = inspect_store(cluster.store, verify=True, keys=cluster_store_keys("signed"))
    entry = next(e for e in report.entries if e.key == ex.key)
    assert (entry.signature, entry.valid, entry.refused) == ("unsigned", False, True)
    # P does not count an unsigned entry as stored: its next prefill publishes a signed one over it.
    cluster.p.chat(messages, max_tokens=1)
    cluster.wait_for("prefill", lambda t: auth.has_accepted_tag(fmt.parse_header(path).metadata,
                                                                cluster_store_keys("signed")))
    offset = len(cluster.log("decode"))
    assert cluster.d.chat(messages, max_tokens=TOKENS).token_ids == ex.baseline_ids
    assert cluster.wait_for("decode", lambda t: skip_line_for(t[offset:], ex.key))


@e2e
def test_rotation_old_key_served_unknown_key_refused(cluster):
    ex = cluster.exchange("During a key rotation entries of the old key are still served.", max_tokens=TOKENS)
    assert ex.key and ex.decode_ids == ex.baseline_ids
    path = fmt.entry_path(cluster.store, ex.key)
    messages = user_messages(ex.prompt)
    resign(path, OLD)
    offset = len(cluster.log("decode"))
    assert cluster.d.chat(messages, max_tokens=TOKENS).token_ids == ex.baseline_ids
    assert cluster.wait_for("decode", lambda t: skip_line_for(t[offset:], ex.key)), "D did not serve OLD's entry"
    assert not redo_lines_for(cluster.log("decode")[offset:], ex.key)
    resign(path, OTHER)
    offset = len(cluster.log("decode"))
    assert cluster.d.chat(messages, max_tokens=TOKENS).token_ids == ex.baseline_ids
    redo = d_redo_since(cluster, offset, ex.key)
    assert (f"bad signature: signed with key {auth.derive_key(OTHER).key_id}, which this reader does not "
            f"accept") in redo.reason
    assert path.exists()
    report = inspect_store(cluster.store, verify=True, keys=cluster_store_keys("signed"))
    signatures = {e.key: e.signature for e in report.entries}
    assert signatures[ex.key] == "bad signature"
    assert "verified" in signatures.values()
