"""The FS store against foreign files, other users and hostile entries (issue 11, items 4-9).

Real files and the real CLI; no torch (the torch reader's side is in
test_fs_store.py). Every test here fails on the code before the fix:

- one rule for what an entry and a temp file are: prune, eviction, a bounded
  publish and `store check --fix` leave every other name alone;
- an entry this user cannot read is unchecked, never deleted;
- a damaged or crafted header is EntryCorrupt with a reason, for the reader,
  inspect-store and store check alike, never a TypeError/RecursionError;
- a FIFO under an entry name never blocks; a header claiming 1 TiB is never
  allocated.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

import pytest

from connectors.store import format as fmt
from connectors.store.eviction import BoundedPublish, evict
from kvctl.store.inspect import fix_store, inspect_store

IDENTITY = fmt.KVIdentity(model="tiny", num_layers=2, kv_parts=2, kv_heads=2, head_size=4, dtype="F32")
HIDDEN = 8
HOUR = 3600.0

# Names a user may well keep next to (or in) a store: none of them is ours.
FOREIGN_FILES = ("model.safetensors", "My Weights.safetensors", "adapter_model.safetensors",
                 ".vimrc-backup.tmp", "notes.txt", "AB" * 16 + ".safetensors", ".%s.tmp" % ("ab" * 16),
                 ".%s.1.zz.tmp" % ("ab" * 16), "%s.safetensors.bak" % ("ab" * 16))
FOREIGN_DIRS = ("x.safetensors", "cd" * 16 + ".safetensors")


def blobs(tokens: list[int], identity: fmt.KVIdentity = IDENTITY) -> dict[str, fmt.TensorBlob]:
    n = len(tokens)
    shape = (identity.num_layers, identity.kv_parts, n, identity.kv_heads, identity.head_size)
    kv = array("f", (float(i % 251) for i in range(n * identity.num_layers * identity.kv_parts
                                                    * identity.kv_heads * identity.head_size)))
    return {"token_ids": fmt.TensorBlob("I64", (n,), fmt.token_bytes(tokens)),
            "kv": fmt.TensorBlob("F32", shape, kv),
            "hidden": fmt.TensorBlob("F32", (1, HIDDEN), array("f", (0.5,) * HIDDEN))}


def put(root: Path, tokens: list[int], guard=None) -> Path:
    return fmt.write_entry(root, fmt.compute_key(IDENTITY, tokens), IDENTITY, blobs(tokens),
                           fsync=False, guard=guard)


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + hlen]), raw[8 + hlen:]


def rewrite(path: Path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def kvctl(*args: str, preexec=None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, preexec_fn=preexec)


def no_traceback(result: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in result.stdout + result.stderr


def user_files(root: Path) -> dict[str, Path]:
    """Foreign files and dirs, a symlink under an entry's name to a user's file, and a FIFO."""
    made = {}
    for name in FOREIGN_FILES:
        made[name] = root / name
        made[name].write_bytes(b"user data " * 100)
    for name in FOREIGN_DIRS:
        made[name] = root / name
        made[name].mkdir()
        (made[name] / "inside").write_text("user data")
    outside = root.parent / "weights.bin"
    outside.write_bytes(b"w" * 1000)
    made["link"] = root / ("ef" * 16 + ".safetensors")
    made["link"].symlink_to(outside)
    made["fifo"] = root / ("12" * 16 + ".safetensors")
    os.mkfifo(made["fifo"])
    for path in made.values():
        age(path, 10 * HOUR)
    age(outside, 10 * HOUR)
    return made


def assert_untouched(made: dict[str, Path]) -> None:
    for name, path in made.items():
        assert os.path.lexists(path), f"{name} was removed"
        assert time.time() - path.lstat().st_mtime > 9 * HOUR, f"{name} was touched"
    target = made["link"].resolve()
    assert target.exists() and time.time() - target.stat().st_mtime > 9 * HOUR, "touched through a symlink"


# ---------------------------------------------------------------- item 4: one rule, foreign files survive

@pytest.mark.parametrize("name, kind", [
    ("0123456789abcdef0123456789abcdef.safetensors", "entry"),
    ("0123456789ABCDEF0123456789abcdef.safetensors", "foreign"),  # not lowercase hex
    ("0123456789abcdef0123456789abcde.safetensors", "foreign"),  # 31 digits
    ("model.safetensors", "foreign"),
    (".0123456789abcdef0123456789abcdef.4242.deadbeef.tmp", "temp"),
    (".0123456789abcdef0123456789abcdef.4242.deadbee.tmp", "foreign"),  # 7 random hex digits
    (".0123456789abcdef0123456789abcdef.pid.deadbeef.tmp", "foreign"),
    (".vimrc-backup.tmp", "foreign"),
    (".kvctl-store.lock", "lock"),
])
def test_one_naming_rule(tmp_path, name, kind):
    path = tmp_path / name
    path.write_bytes(b"")
    assert fmt.file_kind(name, path.lstat()).value == kind
    path.unlink()
    path.mkdir()  # a directory is never an entry, a temp file or the lock, whatever its name
    assert fmt.file_kind(name, path.lstat()) is fmt.FileKind.FOREIGN


def test_temp_names_written_are_temp_names(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (seen.append(Path(src).name), real_replace(src, dst)))
    put(tmp_path, [1, 2, 3])
    assert len(seen) == 1 and fmt.is_temp_name(seen[0])


def test_prune_older_than_keeps_user_files(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    made = user_files(root)
    old = put(root, [1, 2, 3])
    age(old, 2 * HOUR)
    fresh = put(root, [4, 5, 6])
    result = kvctl("store", "prune", str(root), "--older-than", "3600", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["removed"] == [old.name]
    assert not old.exists() and fresh.exists()
    assert_untouched(made)


def test_prune_max_bytes_zero_keeps_user_files(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    made = user_files(root)
    entries = [put(root, [i, i + 1]) for i in range(3)]
    result = kvctl("store", "prune", str(root), "--max-bytes", "0", "--json")
    assert result.returncode == 0, result.stderr  # a directory named x.safetensors made this exit 3
    doc = json.loads(result.stdout)
    assert sorted(doc["removed"]) == sorted(p.name for p in entries) and doc["total_bytes"] == 0
    assert_untouched(made)


def test_bounded_publish_keeps_user_files(tmp_path):
    """A bounded store evicts only entries: a real publish through BoundedPublish, as FSStore.save does."""
    root = tmp_path / "store"
    root.mkdir()
    made = user_files(root)
    size = put(tmp_path, [0, 0]).stat().st_size
    guard = BoundedPublish(root, max_bytes=2 * size, ttl_seconds=HOUR)
    published = [put(root, [i, i + 1], guard=guard) for i in range(5)]
    assert [p.exists() for p in published] == [False, False, False, True, True]
    assert_untouched(made)


def test_check_fix_keeps_user_files(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    made = user_files(root)
    good = put(root, [1, 2, 3])
    leftover = root / f".{'ab' * 16}.77.deadbeef.tmp"
    leftover.write_bytes(b"\0" * 64)
    age(leftover, 2 * HOUR)
    result = kvctl("store", "check", str(root), "--fix", "--grace", "0", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert [r["file"] for r in doc["fix"]["removed"]] == [leftover.name]
    assert doc["passed"] is True and doc["num_valid"] == 1 and good.exists()
    foreign = {f["file"] for f in doc["foreign_files"]}
    assert foreign == {p.name for p in made.values()}
    assert_untouched(made)


def test_eviction_never_counts_foreign_bytes(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    user_files(root)
    (root / "big.safetensors").write_bytes(b"\0" * 100_000)
    entry = put(root, [1, 2])
    report = evict(root, max_bytes=entry.stat().st_size)
    assert report.removed == [] and report.total_bytes == entry.stat().st_size


def test_publish_never_replaces_a_non_file_at_its_name(tmp_path):
    key = fmt.compute_key(IDENTITY, [9, 9])
    taken = fmt.entry_path(tmp_path, key)
    taken.mkdir()
    with pytest.raises(fmt.NameTaken, match="a directory"):
        fmt.write_entry(tmp_path, key, IDENTITY, blobs([9, 9]), fsync=False)
    taken.rmdir()
    os.mkfifo(taken)
    with pytest.raises(fmt.NameTaken, match="a FIFO"):
        fmt.write_entry(tmp_path, key, IDENTITY, blobs([9, 9]), fsync=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [taken.name]  # no temp file left either


# ---------------------------------------------------------------- item 5: unreadable entries are unchecked

def test_unreadable_entry_is_unchecked_never_deleted():
    """As another user: a root-owned 0600 entry is reported unchecked; --fix leaves it; check fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create an entry another user cannot read")
    nobody = pwd.getpwnam("nobody")
    with tempfile.TemporaryDirectory(prefix="kvctl-perm-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o777)  # the other user may list and unlink: only the entry's mode protects it
        private = put(root, [1, 2, 3])
        os.chmod(private, 0o600)
        readable = put(root, [4, 5, 6])
        os.chmod(readable, 0o644)

        def as_nobody():
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)

        # The CLI in-process, in a forked child that became `nobody`: this python's own files
        # live under /root, which `nobody` cannot read, so everything is imported before the fork.
        from kvctl.cli import main

        # The same command once as root first, on an empty store: modules the CLI imports
        # lazily (typer's help option, rich's renderers) are then loaded before the fork.
        with tempfile.TemporaryDirectory(prefix="kvctl-warm-") as warm, \
                contextlib.redirect_stdout(io.StringIO()):
            main(["store", "check", warm, "--fix", "--grace", "0", "--json"])

        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(read_fd)
                as_nobody()
                sys.stdout = os.fdopen(write_fd, "w")  # pytest's capture is not fd 1
                rc = main(["store", "check", str(root), "--fix", "--grace", "0", "--json"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 99
            except BaseException:
                import traceback
                traceback.print_exc()
                rc = 98
            finally:
                sys.stdout.flush()
            os._exit(rc)
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            out = pipe.read()
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        doc = json.loads(out)
        assert private.exists(), "an entry this user cannot read was deleted"
        assert rc == 1 and doc["passed"] is False
        assert doc["num_unchecked"] == 1 and doc["num_valid"] == 1 and doc["num_invalid"] == 0
        (unchecked,) = [e for e in doc["entries"] if e["file"] == private.name]
        assert unchecked["valid"] is None and "Permission denied" in unchecked["error"]
        kept = {k["file"]: k["reason"] for k in doc["fix"]["kept"]}
        assert "never removed" in kept[private.name] and doc["fix"]["removed"] == []


# ---------------------------------------------------------------- items 6, 7, 9: hostile headers

def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# name -> (how the header is changed, words the reason must contain)
def _meta(**values):
    def change(h):
        h["__metadata__"].update(values)
    return change


def _rec(tensor, **values):
    def change(h):
        h[tensor].update(values)
    return change


def _set(key, value):
    def change(h):
        h[key] = value
    return change


def _crafted_kv(h):
    # Same bytes, other shape: [1, 2, 6, 2, 4] where the identity says [2, 2, 3, 2, 4].
    h["kv"]["shape"] = [1, 2, 6, 2, 4]


HOSTILE_HEADERS = {
    "metadata value null": (_meta(model=None), "model"),
    "metadata value list": (_meta(num_layers=["2"]), "num_layers"),
    "unknown metadata not a string": (_meta(note={"a": [1]}), "strings only"),
    "metadata is a list": (_set("__metadata__", ["format", "kvctl-fs-kv"]), "__metadata__"),
    "metadata is null": (_set("__metadata__", None), "not a kvctl-fs-kv entry"),
    "kv dtype a list": (_rec("kv", dtype=["F32"]), "dtype"),
    "kv dtype an object": (_rec("kv", dtype={"F32": 1}), "dtype"),
    "kv dtype null": (_rec("kv", dtype=None), "dtype"),
    "identity dtype a list": (_meta(dtype=["F32"]), "dtype"),
    "identity dtype unknown": (_meta(dtype="F33"), "dtype"),
    "hidden dtype a number": (_rec("hidden", dtype=4), "dtype"),
    "shape of floats": (_rec("kv", shape=[2.0, 2, 3, 2, 4]), "shape"),
    "shape with NaN": (_rec("kv", shape=[float("nan"), 2, 3, 2, 4]), "shape"),
    "shape of bools": (_rec("token_ids", shape=[True]), "shape"),
    "shape nested": (_rec("kv", shape=[[2], 2, 3, 2, 4]), "shape"),
    "shape a string": (_rec("kv", shape="2,2,3,2,4"), "shape"),
    "offsets strings": (_rec("token_ids", data_offsets=["0", "24"]), "data_offsets"),
    "offsets three": (_rec("token_ids", data_offsets=[0, 24, 48]), "data_offsets"),
    "record a list": (_set("kv", [1, 2]), "record"),
    "crafted kv shape": (_crafted_kv, "identity says"),
    "token_ids I32": (lambda h: h["token_ids"].update(dtype="I32", shape=[6]), "token_ids"),
    "hidden 3-D": (_rec("hidden", shape=[1, 2, 4]), "hidden"),
    "hidden more rows than tokens": (lambda h: h["hidden"].update(shape=[4, 2]), "hidden"),
    "num_tokens padded": (_meta(num_tokens=" 3"), "num_tokens"),
    "num_tokens negative": (_meta(num_tokens="-3"), "num_tokens"),
    "num_tokens huge": (_meta(num_tokens="9" * 5000), "num_tokens"),
    "num_layers with underscore": (_meta(num_layers="0_2"), "num_layers"),
    "kv_parts 3": (_meta(kv_parts="3"), "kv_parts"),
    "tp_rank >= tp_size": (_meta(tp_rank="1"), "tp_rank"),
    "created inf": (_meta(created="inf"), "created"),
    "created nan": (_meta(created="nan"), "created"),
    "created 1e400": (_meta(created="1e400"), "created"),
    "checksum other algorithm": (_meta(checksum="md5:00"), "checksum"),
    "header a list": (lambda h: None, "not a JSON object"),  # replaced below: whole header
}
RAW_HEADERS = {
    "header a list": b"[1, 2, 3]",
    "header a string": b'"kvctl-fs-kv"',
    "header not UTF-8": b'{"a": "\xff\xfe"}',
    "header integer of 5000 digits": b'{"a": ' + b"9" * 5000 + b"}",
    "header nested 100000 deep": ('{"junk": ' + deep(100_000) + "}").encode(),
    "metadata nested 50000 deep": ('{"__metadata__": {"model": ' + deep(50_000) + "}}").encode(),
}
HOSTILE_HEADERS.pop("header a list")


def hostile_entry(root: Path, name: str, tokens: list[int]) -> Path:
    """An entry with hostile header `name`, under the name its (intact) tokens and identity hash to."""
    path = put(root, tokens)
    header, data = header_of(path)
    if name in RAW_HEADERS:
        rewrite(path, RAW_HEADERS[name], data)
    else:
        HOSTILE_HEADERS[name][0](header)
        rewrite(path, json.dumps(header, separators=(",", ":")).encode(), data)
    return path


def hostile_store(root: Path) -> dict[str, Path]:
    """One entry per hostile header."""
    names = sorted(HOSTILE_HEADERS) + sorted(RAW_HEADERS)
    return {name: hostile_entry(root, name, [100 + i, 1, 2]) for i, name in enumerate(names)}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS) + sorted(RAW_HEADERS))
def test_hostile_header_is_entry_corrupt(tmp_path, name):
    path = hostile_entry(tmp_path, name, [1, 2, 3])
    words = HOSTILE_HEADERS[name][1] if name in HOSTILE_HEADERS else ""
    for read in (fmt.parse_header, fmt.read_entry):
        with pytest.raises(fmt.EntryCorrupt) as info:
            read(path)
        assert words in info.value.reason, (read.__name__, info.value.reason)
        assert len(info.value.reason) < 400
    (entry,) = inspect_store(tmp_path, verify=True).entries
    assert entry.valid is False and words in entry.error


def test_moderately_nested_value_is_described_not_repeated(tmp_path):
    """A value nested 900 deep parses, and the reason describes it without recursing into it."""
    path = put(tmp_path, [1, 2, 3])
    header, data = header_of(path)
    text = json.dumps(header, separators=(",", ":")).replace('"dtype":"F32"', '"dtype":' + deep(900), 1)
    rewrite(path, text.encode(), data)
    with pytest.raises(fmt.EntryCorrupt, match="dtype is a list"):
        fmt.parse_header(path)


def test_cli_reports_every_hostile_entry_and_fix_removes_them(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    made = hostile_store(root)
    good = put(root, [7, 7, 7])
    for args in (["inspect-store", str(root)], ["inspect-store", str(root), "--verify"],
                 ["store", "check", str(root)]):
        result = kvctl(*args)
        assert no_traceback(result), (args, result.stderr[-3000:])
        assert result.returncode == (0 if args[-1] == str(root) and args[0] == "inspect-store" else 1), args
    check = kvctl("store", "check", str(root), "--json")
    doc = json.loads(check.stdout)
    errors = {e["file"]: e["error"] for e in doc["entries"]}
    assert doc["num_invalid"] == len(made) and doc["num_valid"] == 1
    for name, path in made.items():
        assert errors[path.name], name
    fixed = kvctl("store", "check", str(root), "--fix")
    assert fixed.returncode == 0 and no_traceback(fixed), fixed.stdout[-3000:] + fixed.stderr[-3000:]
    assert "store OK" in fixed.stdout
    assert sorted(p.name for p in root.iterdir()) == [good.name]


def test_list_dtype_renders_before_fix_deletes(tmp_path):
    """Item 9: a list where a dtype string belongs crashed the table after --fix had deleted the file."""
    path = put(tmp_path, [1, 2, 3])
    header, data = header_of(path)
    header["__metadata__"]["dtype"] = ["F32"]  # the identity's dtype; kv's own record stays "F32"
    rewrite(path, header, data)
    result = kvctl("store", "check", str(tmp_path), "--fix")
    assert no_traceback(result) and result.returncode == 0, result.stdout + result.stderr
    assert "invalid" in result.stdout and "removed" in result.stdout
    assert not path.exists()


def test_odd_file_names_render(tmp_path):
    (tmp_path / "[bold]markup[red].txt").write_text("x")
    (tmp_path / os.fsdecode(b"not-utf8-\xff\xfe.bin")).write_text("x")
    put(tmp_path, [1, 2])
    result = kvctl("inspect-store", str(tmp_path))
    assert result.returncode == 0 and no_traceback(result), result.stderr
    assert "[bold]markup[red].txt" in result.stdout and "not-utf8-\\xff\\xfe.bin" in result.stdout
    doc = json.loads(kvctl("inspect-store", str(tmp_path), "--json").stdout)
    assert len(doc["foreign_files"]) == 2


# ---------------------------------------------------------------- item 8: a FIFO under an entry name

def test_fifo_under_an_entry_name_never_blocks(tmp_path):
    key = fmt.compute_key(IDENTITY, [1, 2, 3])
    fifo = fmt.entry_path(tmp_path, key)
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise TimeoutError("blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)  # the old reader blocked forever in open()
    try:
        for read in (fmt.parse_header, fmt.read_entry, fmt.verify_entry):
            with pytest.raises(fmt.EntryCorrupt, match="a FIFO, not a regular file"):
                read(fifo)
        scan = fmt.scan_store(tmp_path)
        assert scan.foreign == [fifo] and not scan.entries and not scan.corrupt
        result = kvctl("store", "check", str(tmp_path), "--fix", "--json", timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert result.returncode == 0 and [f["file"] for f in json.loads(result.stdout)["foreign_files"]] == [fifo.name]
    assert fifo.exists()


def test_symlink_under_an_entry_name_is_never_followed(tmp_path):
    real = put(tmp_path, [1, 2, 3])
    other = tmp_path / "other"
    other.mkdir()
    link = fmt.entry_path(other, real.name[: -len(fmt.ENTRY_SUFFIX)])
    link.symlink_to(real)
    with pytest.raises(fmt.EntryCorrupt, match="a symbolic link"):
        fmt.read_entry(link)
    report = inspect_store(other, verify=True)
    assert report.entries == [] and [f.path for f in report.foreign_files] == [link]


# ---------------------------------------------------------------- item 9: a header claiming 1 TiB

def sparse_claim(root: Path, claim: int, name_tokens: list[int] | None = None) -> Path:
    """An entry whose hidden tensor claims `claim` bytes; the file is made that long, sparse."""
    path = put(root, [1, 2, 3])
    header, data = header_of(path)
    width = claim // 4
    begin = header["hidden"]["data_offsets"][0]
    header["hidden"].update(shape=[1, width], data_offsets=[begin, begin + 4 * width])
    if name_tokens is not None:  # published under another prompt's key
        path.unlink()
        path = fmt.entry_path(root, fmt.compute_key(IDENTITY, name_tokens))
    rewrite(path, header, data[:begin])
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) + 4 * width)
    return path


def test_one_tib_claim_is_listed_and_verified_without_allocating(tmp_path):
    path = sparse_claim(tmp_path, 1 << 40, name_tokens=[5, 6, 7])
    assert path.stat().st_size > 1 << 40
    listed = kvctl("inspect-store", str(tmp_path), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["entries"][0]["valid"] is None
    # The key is checked first: this re-headered, renamed file fails before the data is streamed.
    checked = kvctl("store", "check", str(tmp_path), "--json", timeout=60)
    assert checked.returncode == 1 and no_traceback(checked), checked.stderr[-2000:]
    (entry,) = json.loads(checked.stdout)["entries"]
    assert "not the file name" in entry["error"]


def _limit_memory():
    limit = 3 << 30  # address space: enough for python and rich, far less than the claim
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_huge_claim_with_a_matching_key_is_streamed(tmp_path):
    """The key matches, so the whole claimed data section is checksummed: in bounded memory."""
    sparse_claim(tmp_path, 16 << 30)
    result = kvctl("store", "check", str(tmp_path), "--json", preexec=_limit_memory, timeout=300)
    assert result.returncode == 1 and no_traceback(result), result.stderr[-2000:]
    (entry,) = json.loads(result.stdout)["entries"]
    assert "checksum mismatch" in entry["error"]


def test_stream_check_equals_whole_read(tmp_path, monkeypatch):
    """verify_entry (chunked, hole-aware) agrees with read_entry on valid and damaged entries."""
    monkeypatch.setattr(fmt, "READ_CHUNK_BYTES", 24)  # many chunks, split token ids
    good = put(tmp_path, list(range(40)))
    assert fmt.verify_entry(good).num_tokens == 40
    fmt.read_entry(good)
    bad = put(tmp_path, [-1, 5, -7])
    with pytest.raises(fmt.EntryCorrupt, match="2 negative token ids"):
        fmt.verify_entry(bad)
    flipped = put(tmp_path, list(range(50, 60)))
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 1
    flipped.write_bytes(bytes(raw))
    for read in (fmt.verify_entry, fmt.read_entry):
        with pytest.raises(fmt.EntryCorrupt, match="checksum mismatch"):
            read(flipped)


# ---------------------------------------------------------------- fuzz: nothing but EntryCorrupt

ODD_VALUES = (None, True, 0, -1, 2 ** 70, 1.5, float("inf"), "", "F32", "I64", "3", "x" * 300,
              [], [1], ["F32"], [[2]], {}, {"a": None}, [-1, 24], [0, 2 ** 64])


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _replace(doc, path, value):
    if not path:
        return value
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return doc


def test_fuzzed_headers_only_ever_raise_entry_corrupt(tmp_path):
    """Every value of a real header replaced by odd ones, and random byte flips: EntryCorrupt or valid."""
    import io
    import random

    from rich.console import Console

    from kvctl.views.output import Output
    from kvctl.views.store import render_store_report

    rng = random.Random(11)
    template = put(tmp_path, [3, 1, 4])
    header, data = header_of(template)
    raw_header = template.read_bytes()[8:8 + struct.unpack("<Q", template.read_bytes()[:8])[0]]
    cases = [(p, v) for p in _paths(header) for v in ODD_VALUES]
    cases += [("flip", i) for i in range(200)]
    outcomes = {"corrupt": 0, "valid": 0}
    for n, (where, value) in enumerate(cases):
        root = tmp_path / f"case{n}"
        root.mkdir()
        path = root / template.name
        if where == "flip":
            damaged = bytearray(raw_header)
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            rewrite(path, bytes(damaged), data)
        else:
            rewrite(path, json.dumps(_replace(json.loads(json.dumps(header)), where, value)).encode(), data)
        for read in (fmt.parse_header, fmt.read_entry, fmt.verify_entry):
            try:
                read(path)
            except fmt.EntryCorrupt:
                outcomes["corrupt"] += read is fmt.verify_entry
            else:
                outcomes["valid"] += read is fmt.verify_entry
        report = inspect_store(root, verify=True)
        out = Output(stdout=Console(file=io.StringIO(), width=200))
        render_store_report(report, out)
        fix_store(report, temp_grace_s=0)
    assert outcomes["corrupt"] > 0.8 * len(cases), outcomes
