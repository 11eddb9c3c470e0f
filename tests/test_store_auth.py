"""Authenticated entries (connectors.store.auth): a keyed reader serves only what a key holder wrote.

Real files, the real writer and readers. A forged entry is made the way a
writer without the key would (store_forgery.forge): KV noise added, the xxh3
checksum recomputed, the header rewritten (with the original tag left in, or none).
"""

from __future__ import annotations

import pytest
import torch
from store_forgery import forge

from connectors.config.validate import ConfigError, open_store_keys, parse_fs_settings
from connectors.store import auth, format as fmt
from connectors.store.fs_store import FSStore
from connectors.v1 import transfer

IDENT = fmt.KVIdentity(model="m", num_layers=3, kv_parts=2, kv_heads=2, head_size=32, dtype="F32")
OLD, NEW = auth.StoreKeys.from_secrets(["old-secret"]), auth.StoreKeys.from_secrets(["new-secret"])
ROTATING = auth.StoreKeys.from_secrets(["new-secret", "old-secret"])


def make_entry(tokens: int = 21, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, tokens, 2, 32, generator=g)
    hidden = torch.randn(1, 64, generator=g)
    ids = torch.randint(0, 2000, (tokens,), generator=g).tolist()
    return ids, kv, hidden


def load_into(store: FSStore, ids):
    written = []
    entry = store.load_into(IDENT, ids, lambda layer, kv: written.append(layer))
    return entry, written


def test_signed_entry_round_trips_and_carries_a_tag(tmp_path):
    store = FSStore(tmp_path, keys=NEW)
    ids, kv, hidden = make_entry()
    saved = store.save(IDENT, ids, kv, hidden)
    header = fmt.parse_header(saved.path)
    key_id, tag = auth.signature_of(header.metadata)
    assert key_id == NEW.signer.key_id and len(tag) == 64 and tag != auth.BLANK_TAG
    assert "new-secret" not in saved.path.read_bytes().decode("latin-1")  # only the id, never the key
    got = store.load(IDENT, ids)
    assert torch.equal(got.kv, kv)
    entry, written = load_into(store, ids)
    assert written == [0, 1, 2]
    assert fmt.verify_entry(saved.path, NEW).num_tokens == len(ids)
    # An unkeyed reader ignores the tag: keyed and unkeyed instances can share a store.
    assert torch.equal(FSStore(tmp_path).load(IDENT, ids).kv, kv)


def test_unsigned_entry_is_refused_before_anything_is_written_and_left_in_place(tmp_path):
    ids, kv, hidden = make_entry()
    saved = FSStore(tmp_path).save(IDENT, ids, kv, hidden)
    keyed = FSStore(tmp_path, keys=NEW)
    with pytest.raises(auth.EntryUnauthenticated) as e:
        load_into(keyed, ids)
    assert e.value.reason.startswith("unsigned")
    assert not isinstance(e.value, fmt.EntryCorrupt)  # the consumers delete only EntryCorrupt
    written = []
    with pytest.raises(auth.EntryUnauthenticated):
        keyed.load_into(IDENT, ids, lambda layer, kv: written.append(layer))
    assert written == []  # refused from the header: nothing reached the cache
    with pytest.raises(auth.EntryUnauthenticated, match="unsigned"):
        keyed.load(IDENT, ids)
    with pytest.raises(auth.EntryUnauthenticated, match="unsigned"):
        fmt.verify_entry(saved.path, NEW)
    assert saved.path.exists()
    # The keyed producer does not count it as stored: it publishes its own, signed one over it.
    assert not keyed.has_entry(saved.key)
    keyed.save(IDENT, ids, kv, hidden)
    assert keyed.has_entry(saved.key) and torch.equal(keyed.load(IDENT, ids).kv, kv)


@pytest.mark.parametrize("keep_tag", [True, False])
def test_forged_entry_is_refused_by_a_keyed_reader(tmp_path, keep_tag):
    ids, kv, hidden = make_entry()
    keyed = FSStore(tmp_path, keys=NEW)
    saved = keyed.save(IDENT, ids, kv, hidden)
    forge(saved.path, keep_tag=keep_tag)
    # What the probe showed: the checksum is right, so a reader without the key serves the noise.
    assert fmt.verify_entry(saved.path).num_tokens == len(ids)
    assert not torch.equal(FSStore(tmp_path).load(IDENT, ids).kv, kv)
    want = "bad signature" if keep_tag else "unsigned"
    for read in (lambda: load_into(keyed, ids), lambda: keyed.load(IDENT, ids),
                 lambda: fmt.verify_entry(saved.path, NEW),
                 lambda: transfer.check_entry(tmp_path, IDENT, ids, NEW)):
        with pytest.raises(auth.EntryUnauthenticated) as e:
            read()
        assert e.value.reason.startswith(want), e.value.reason
    check = transfer.find_entry(tmp_path, IDENT, ids, 1, NEW)
    assert not check.found and check.reason.startswith(f"refused: {want}") and check.corrupt == ()
    assert saved.path.exists()


def test_changed_header_breaks_the_tag(tmp_path):
    ids, kv, hidden = make_entry()
    saved = FSStore(tmp_path, keys=NEW).save(IDENT, ids, kv, hidden)
    raw = bytearray(saved.path.read_bytes())
    at = raw.index(b'"created":"') + len(b'"created":"')
    raw[at] = ord("1") if raw[at] != ord("1") else ord("2")  # same length, still valid metadata
    saved.path.write_bytes(bytes(raw))
    with pytest.raises(auth.EntryUnauthenticated, match="bad signature: the tag does not match"):
        fmt.verify_entry(saved.path, NEW)


def test_rotation_first_key_signs_every_key_verifies(tmp_path):
    old_ids, kv, hidden = make_entry(seed=1)
    new_ids, kv2, hidden2 = make_entry(seed=2)
    FSStore(tmp_path, keys=OLD).save(IDENT, old_ids, kv, hidden)
    rotating = FSStore(tmp_path, keys=ROTATING)
    new_entry = rotating.save(IDENT, new_ids, kv2, hidden2)
    assert auth.signature_of(fmt.parse_header(new_entry.path).metadata)[0] == NEW.signer.key_id
    # During the rotation both entries are served; an instance still on the old key
    # refuses the new key's entries (by id, from the header alone).
    assert torch.equal(rotating.load(IDENT, old_ids).kv, kv)
    assert torch.equal(rotating.load(IDENT, new_ids).kv, kv2)
    assert rotating.has_entry(fmt.compute_key(IDENT, old_ids))
    with pytest.raises(auth.EntryUnauthenticated, match=f"signed with key {NEW.signer.key_id}, which this "
                                                         f"reader does not accept"):
        FSStore(tmp_path, keys=OLD).load(IDENT, new_ids)
    # After it: only the new key; the old key's entries are refused (and republished by P).
    done = FSStore(tmp_path, keys=NEW)
    with pytest.raises(auth.EntryUnauthenticated, match="bad signature"):
        done.load(IDENT, old_ids)
    assert not done.has_entry(fmt.compute_key(IDENT, old_ids))


def test_a_tag_made_with_another_secret_but_a_copied_key_id_fails(tmp_path):
    """The key id is a label, not a credential: a tag must verify under the named key."""
    ids, kv, hidden = make_entry()
    impostor = auth.StoreKeys([auth.StoreKey(NEW.signer.key_id, auth.derive_key("guess").mac_key)])
    saved = FSStore(tmp_path, keys=impostor).save(IDENT, ids, kv, hidden)
    with pytest.raises(auth.EntryUnauthenticated, match="bad signature: the tag does not match"):
        fmt.verify_entry(saved.path, NEW)


def test_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    monkeypatch.delenv(auth.KEY_FILE_ENV, raising=False)
    assert auth.keys_from() is None
    key_file = tmp_path / "store_key"
    key_file.write_text("# rotated 2026-12\nnew-secret\n\nold-secret\n")
    assert auth.keys_from(str(key_file)).key_ids == ROTATING.key_ids
    monkeypatch.setenv(auth.KEY_ENV, "new-secret, old-secret")
    assert auth.keys_from().key_ids == ROTATING.key_ids
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(key_file))
    assert auth.keys_from().key_ids == ROTATING.key_ids
    # A server told to authenticate never starts without a key it can use.
    settings = parse_fs_settings({"fs_storage_path": str(tmp_path), "store_key_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="store_key_file.*No such file"):
        open_store_keys(settings)
    monkeypatch.delenv(auth.KEY_FILE_ENV)
    monkeypatch.setenv(auth.KEY_ENV, " , ")
    with pytest.raises(ConfigError, match="KVCTL_STORE_KEY is set but holds no key"):
        open_store_keys(parse_fs_settings({"fs_storage_path": str(tmp_path)}))
    assert "secret" not in repr(ROTATING) + repr(ROTATING.signer) + auth.describe(ROTATING)


def test_launch_keys_the_store_by_default(tmp_path, monkeypatch):
    from kvctl.cluster.state import launch_store_keys
    from kvctl.errors import BadInput

    monkeypatch.delenv(auth.KEY_FILE_ENV, raising=False)
    [generated] = launch_store_keys(True)
    assert len(generated) == 64 and int(generated, 16) >= 0 and launch_store_keys(True) != (generated,)
    assert launch_store_keys(False) == ()
    key_file = tmp_path / "keys"
    key_file.write_text("new-secret\nold-secret\n")
    assert launch_store_keys(True, key_file) == ("new-secret", "old-secret")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(key_file))
    assert launch_store_keys(True) == ("new-secret", "old-secret")
    key_file.write_text("# nothing\n")
    with pytest.raises(BadInput, match="holds no key") as e:
        launch_store_keys(True, key_file)
    assert e.value.fields == ("store_key_file",)
    key_file.write_text("a key with spaces\n")
    with pytest.raises(BadInput, match="whitespace"):
        launch_store_keys(True, key_file)


def test_servers_get_the_keys_in_their_environment(tmp_path, monkeypatch):
    from kvctl.runtime.base import InstanceSpec, vllm_server_env

    spec = InstanceSpec(cluster="c", role="decode", model=tmp_path, served_model_name="m", dtype="float32",
                        port=1, cwd=tmp_path, log_path=tmp_path / "log", store_keys=("k1", "k2"))
    assert vllm_server_env(spec)[auth.KEY_ENV] == "k1,k2"
    assert "k1" not in repr(spec)
    unkeyed = InstanceSpec(cluster="c", role="decode", model=tmp_path, served_model_name="m", dtype="float32",
                           port=1, cwd=tmp_path, log_path=tmp_path / "log")
    assert auth.KEY_ENV not in vllm_server_env(unkeyed)


def test_a_damaged_signed_entry_is_corrupt_a_forged_one_is_a_bad_signature(tmp_path):
    """A keyed reader checks the checksum before the tag: a flipped byte is damage (corrupt, removed
    as ever); a forged entry's checksum is right, so only its tag fails (refused, kept)."""
    ids, kv, hidden = make_entry()
    keyed = FSStore(tmp_path, keys=NEW)
    saved = keyed.save(IDENT, ids, kv, hidden)
    raw = bytearray(saved.path.read_bytes())
    raw[-100] ^= 0x55
    saved.path.write_bytes(bytes(raw))
    for read in (lambda: load_into(keyed, ids), lambda: keyed.load(IDENT, ids),
                 lambda: fmt.verify_entry(saved.path, NEW)):
        with pytest.raises(fmt.EntryCorrupt, match="checksum mismatch"):
            read()
