"""kvctl inspect-store / store check on a real store: valid, corrupt, temp and foreign files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest

from connectors.store.format import (
    KVIdentity,
    TensorBlob,
    compute_key,
    token_bytes,
    write_entry,
)
from kvctl.errors import BadInput
from kvctl.store.inspect import fix_store, inspect_store, resolve_store_dir

IDENTITY = KVIdentity(model="tiny", num_layers=2, kv_parts=2, kv_heads=2, head_size=32, dtype="F32")
HIDDEN = 64
HOUR = 3600.0


def put(root: Path, tokens: list[int], identity: KVIdentity = IDENTITY, name_key: str | None = None) -> Path:
    """Write a real entry with deterministic data; `name_key` publishes it under another key."""
    n = len(tokens)
    kv_count = identity.num_layers * identity.kv_parts * n * identity.kv_heads * identity.head_size
    kv = array("f", (float(i % 251) for i in range(kv_count)))
    hidden = array("f", (0.5,) * HIDDEN)
    blobs = {
        "token_ids": TensorBlob("I64", (n,), token_bytes(tokens)),
        "kv": TensorBlob("F32", (identity.num_layers, identity.kv_parts, n, identity.kv_heads,
                                 identity.head_size), kv),
        "hidden": TensorBlob("F32", (1, HIDDEN), hidden),
    }
    key = name_key or compute_key(identity, tokens)
    return write_entry(root, key, identity, blobs, fsync=False)


def flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def store(tmp_path: Path) -> dict[str, Path]:
    """A store with one of each kind of file; returns name -> path."""
    root = tmp_path / "store"
    root.mkdir()
    files = {"root": root}
    files["valid_a"] = put(root, [1, 2, 3, 4, 5])
    files["valid_b"] = put(root, list(range(100, 140)))
    files["flipped"] = put(root, [7, 8, 9])
    flip_byte(files["flipped"], 10)  # inside the hidden tensor: only the checksum notices
    files["truncated"] = put(root, [10, 11, 12, 13])
    with open(files["truncated"], "r+b") as f:
        f.truncate(files["truncated"].stat().st_size - 100)
    files["renamed"] = put(root, [20, 21], name_key="ab" * 16)  # content hashes to another key
    files["garbled_header"] = put(root, [30, 31, 32])
    raw = files["garbled_header"].read_bytes()
    files["garbled_header"].write_bytes(raw.replace(b'"data_offsets"', b'"data_offsetz"', 1))
    files["negative"] = put(root, [-5, 1])
    files["old_temp"] = root / f".{'cd' * 16}.4242.deadbeef.tmp"
    files["old_temp"].write_bytes(b"\0" * 50)
    age(files["old_temp"], 2 * HOUR)
    files["fresh_temp"] = root / f".{'ef' * 16}.4243.cafef00d.tmp"
    files["fresh_temp"].write_bytes(b"\0" * 30)
    files["foreign"] = root / "notes.txt"
    files["foreign"].write_text("not an entry")
    files["foreign_dir"] = root / "subdir"
    files["foreign_dir"].mkdir()
    files["foreign_upper"] = root / ("AB" * 16 + ".safetensors")  # not a lowercase hex key
    files["foreign_upper"].write_bytes(b"x")
    return files


def by_file(report) -> dict[str, object]:
    return {e.path.name: e for e in report.entries}


def test_header_scan_without_verify(store):
    report = inspect_store(store["root"])
    entries = by_file(report)
    assert len(entries) == 7
    valid = entries[store["valid_b"].name]
    assert valid.valid is None and valid.error is None
    assert (valid.num_tokens, valid.identity.num_layers, valid.identity.kv_heads, valid.identity.head_size,
            valid.identity.dtype, valid.hidden_tokens) == (40, 2, 2, 32, "F32", 1)
    assert abs(valid.created - time.time()) < 60
    assert valid.bytes == store["valid_b"].stat().st_size
    # Header-level damage shows without reading data.
    truncated = entries[store["truncated"].name]
    assert truncated.valid is False and "data section" in truncated.error
    garbled = entries[store["garbled_header"].name]
    assert garbled.valid is False and garbled.error
    # Data-level damage needs --verify.
    assert entries[store["flipped"].name].valid is None
    assert entries[store["renamed"].name].valid is None
    assert [t.path for t in report.temp_files] == sorted([store["old_temp"], store["fresh_temp"]])
    assert sorted(f.path.name for f in report.foreign_files) == sorted(
        ["notes.txt", "subdir", store["foreign_upper"].name])
    assert report.total_bytes == sum(store[k].stat().st_size for k in
                                     ("valid_a", "valid_b", "flipped", "truncated", "renamed",
                                      "garbled_header", "negative"))


def test_verify_checks_checksum_key_and_tokens(store):
    entries = by_file(inspect_store(store["root"], verify=True))
    assert entries[store["valid_a"].name].valid is True
    assert entries[store["valid_b"].name].valid is True
    assert "checksum mismatch" in entries[store["flipped"].name].error
    assert "not the file name" in entries[store["renamed"].name].error
    assert "negative token ids" in entries[store["negative"].name].error
    assert {n for n, e in entries.items() if e.valid is False} == {
        store[k].name for k in ("flipped", "truncated", "renamed", "garbled_header", "negative")}


def test_shape_that_contradicts_identity_is_invalid(tmp_path):
    # kv written with 3 layers while the identity claims 2: the key still matches.
    liar = KVIdentity(model="tiny", num_layers=3, kv_parts=2, kv_heads=2, head_size=32, dtype="F32")
    path = put(tmp_path, [1, 2, 3], identity=liar)
    raw = path.read_bytes()
    hlen = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + hlen])
    header["__metadata__"]["num_layers"] = "2"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + hlen:])
    (entry,) = inspect_store(tmp_path).entries
    assert entry.valid is False and "identity says" in entry.error


def test_fix_removes_stale_temp_and_invalid_never_foreign(store):
    report = inspect_store(store["root"], verify=True)
    result = fix_store(report, temp_grace_s=HOUR)
    removed = {p.name for p, _ in result.removed}
    assert removed == {store[k].name for k in ("old_temp", "flipped", "truncated", "renamed",
                                               "garbled_header", "negative")}
    for k in ("valid_a", "valid_b", "fresh_temp", "foreign", "foreign_dir", "foreign_upper"):
        assert store[k].exists(), k
    kept = {p.name: why for p, why in result.kept}
    assert "writer may still own it" in kept[store["fresh_temp"].name]
    assert "never removed" in kept["notes.txt"]
    after = inspect_store(store["root"], verify=True)
    assert [e.valid for e in after.entries] == [True, True]


def test_fix_keeps_an_entry_rewritten_since_the_check(store):
    report = inspect_store(store["root"], verify=True)
    put(store["root"], [7, 8, 9])  # a producer republishes the flipped entry
    result = fix_store(report, temp_grace_s=HOUR)
    assert store["flipped"].name not in {p.name for p, _ in result.removed}
    assert inspect_store(store["root"], verify=True).entries  # and it is valid now
    assert by_file(inspect_store(store["root"], verify=True))[store["flipped"].name].valid is True


def test_resolve_by_cluster_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    store_dir = tmp_path / "s"
    store_dir.mkdir()
    cdir = tmp_path / "home" / "clusters" / "c1"
    cdir.mkdir(parents=True)
    (cdir / "cluster.json").write_text(json.dumps({"name": "c1", "store": str(store_dir)}))
    assert resolve_store_dir(None, "c1") == store_dir
    with pytest.raises(BadInput) as info:
        resolve_store_dir(None, "c2")
    assert "no cluster named 'c2'" in info.value.what and "c1" in info.value.fix
    with pytest.raises(BadInput):
        resolve_store_dir(str(store_dir), "c1")
    with pytest.raises(BadInput):
        resolve_store_dir(str(tmp_path / "missing"), None)


# ---------------------------------------------------------------- CLI

def kvctl(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["KVCTL_HOME"] = str(home)
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def assert_no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_inspect_json_contract(store):
    result = kvctl("inspect-store", str(store["root"]), "--verify", "--json")
    assert result.returncode == 1, result.stderr  # invalid entries fail --verify
    doc = json.loads(result.stdout)
    assert doc["root"] == str(store["root"])
    assert isinstance(doc["total_bytes"], int) and doc["total_bytes"] > 0
    for e in doc["entries"]:
        assert isinstance(e["key"], str) and isinstance(e["num_tokens"], int) and isinstance(e["bytes"], int)
        assert e["valid"] in (True, False) and (e["error"] is None) == e["valid"]
    keys = {e["key"]: e for e in doc["entries"]}
    good = keys[store["valid_b"].name.split(".")[0]]
    assert (good["num_tokens"], good["num_layers"], good["kv_heads"], good["head_size"], good["dtype"]) == (
        40, 2, 2, 32, "F32")
    assert doc["num_invalid"] == 5 and len(doc["temp_files"]) == 2 and len(doc["foreign_files"]) == 3


def test_cli_inspect_human_and_unverified(store):
    result = kvctl("inspect-store", str(store["root"]))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert store["valid_a"].name[:10] in out
    assert "temp leftover" in out and "foreign file" in out and "notes.txt" in out
    assert "7 entries" in out
    unverified = json.loads(kvctl("inspect-store", str(store["root"]), "--json").stdout)
    assert {e["valid"] for e in unverified["entries"]} == {None, False}


def test_cli_inspect_by_name_and_bad_input(tmp_path, store):
    home = tmp_path / "home"
    (home / "clusters" / "default").mkdir(parents=True)
    (home / "clusters" / "default" / "cluster.json").write_text(json.dumps({"store": str(store["root"])}))
    ok = kvctl("inspect-store", "--json", home=home)  # no DIR, no --name: the default cluster
    assert ok.returncode == 0 and json.loads(ok.stdout)["root"] == str(store["root"])
    for args, words in ((["--name", "nope"], "no cluster named 'nope'"),
                        ([str(tmp_path / "missing")], "does not exist"),
                        ([str(store["foreign"])], "not a directory"),
                        ([str(store["root"]), "--name", "default"], "not both")):
        bad = kvctl("inspect-store", *args, home=home)
        assert bad.returncode == 2, (args, bad.stderr)
        assert words in bad.stderr
        assert_no_traceback(bad)
    bad_json = kvctl("inspect-store", "--name", "nope", "--json", home=home)
    assert bad_json.returncode == 2 and json.loads(bad_json.stdout)["exit_code"] == 2


def test_cli_store_check_and_fix(store):
    check = kvctl("store", "check", str(store["root"]), "--json")
    assert check.returncode == 1
    doc = json.loads(check.stdout)
    assert doc["passed"] is False and doc["fix"] is None and doc["num_invalid"] == 5
    fixed = kvctl("store", "check", str(store["root"]), "--fix", "--grace", "0", "--json")
    assert fixed.returncode == 0, fixed.stdout
    doc = json.loads(fixed.stdout)
    assert doc["passed"] is True and len(doc["fix"]["removed"]) == 7  # 5 invalid + 2 temp
    assert doc["num_valid"] == 2 and len(doc["foreign_files"]) == 3
    again = kvctl("store", "check", str(store["root"]))
    assert again.returncode == 0 and "store OK" in again.stdout
