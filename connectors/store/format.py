"""On-disk format of the FS KV store, version 1 (spec: docs/store-format.md).

This module is the only place that knows the format. It imports neither torch
nor vLLM, so `kvctl inspect-store` can read and check a store anywhere.

Layout of a store directory, and the one rule for what each name is
(`file_kind`; every tool, the reader and eviction use it)::

    <root>/<key>.safetensors           an entry: <key> is 32 lowercase hex digits
    <root>/.<key>.<pid>.<rand>.tmp      an entry being written (<pid> decimal, <rand> 8 hex)
    <root>/.kvctl-store.lock            flock for publish + eviction (bounded stores)
    <root>/.<key>.pending               a save of <key> is under way (empty; its mtime says since when)

A name is an entry, a temp file or a pending marker only if it matches its pattern exactly AND
`lstat` says it is a regular file (symlinks are never followed). Everything
else is foreign: never read, deleted, moved or touched. Only entries, temp
files and pending markers are ever deleted, and only through `remove_store_file`.

A pending marker says "this entry is being saved, its writer has answered
already": a writer that publishes in the background (the V1 FSConnector)
creates it before its request's answer leaves and removes it after the rename
(or when the save fails or is dropped). A reader that misses an entry whose
marker is fresh may wait for it, at most its deadline; a marker older than
that is stale (a dead or stuck writer) and counts for nothing.

An entry is a plain safetensors file (8-byte little-endian header length,
JSON header, data) holding, in this order:

    token_ids  I64   [tokens]                                 the prompt
    kv         dtype [layers, kv_parts, tokens, kv_heads, head_size]
    hidden     dtype [n, hidden_size]      hidden states of the prompt's last n tokens

`kv` is token-major (kv_parts = 2 for K and V, 1 for an MLA latent cache), so
it does not depend on the paged cache's block size or device. FSConnector
stores n = 1: the last prompt token's hidden state is all a decode instance
needs to sample its first token (later tokens come from the KV). The header's
`__metadata__` carries the format name and version, the identity fields that
went into the key, and an xxh3-128 checksum of the whole data section. With
store keys it also carries `mac`, a keyed BLAKE3 tag over data and header
(connectors.store.auth): keyed readers serve only entries whose tag verifies.

Key: blake2b-128 over the identity (model, layers, kv_parts, kv_heads,
head_size, dtype, tp_rank, tp_size, format version) and the token ids. A reader
recomputes the key from the entry's own tokens and identity: an entry whose
name does not match its content is corrupt, and one whose tokens differ from
the prompt is never served.

Entries are published atomically: written to a temp name in the same
directory, fsync'ed (configurable), then renamed over the final name.

Reading is hostile-input safe: anything wrong with a file under an entry name
(damaged or crafted header, wrong shapes, a FIFO, a symlink, a directory) is
`EntryCorrupt` with a reason, never another exception; entries are opened
without following symlinks and without blocking, and nothing is allocated
from what a header merely claims (`verify_entry` streams the data section).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import errno
import hashlib
import json
import math
import os
import re
import secrets
import stat as stat_mod
import struct
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, ContextManager, Iterable, Iterator, Protocol, Sequence

import xxhash

from connectors.store import auth
from connectors.store.errors import StoreError

FORMAT_NAME = "kvctl-fs-kv"
FORMAT_VERSION = 1
ENTRY_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
PENDING_SUFFIX = ".pending"
LOCK_NAME = ".kvctl-store.lock"  # serialises publish + eviction in bounded stores
KEY_HEX_LEN = 32  # 128-bit keys
TEMP_RAND_HEX_LEN = 8  # random part of a temp name
# The one naming rule (with "regular file, by lstat": file_kind).
ENTRY_NAME = re.compile(rf"[0-9a-f]{{{KEY_HEX_LEN}}}{re.escape(ENTRY_SUFFIX)}")
TEMP_NAME = re.compile(rf"\.[0-9a-f]{{{KEY_HEX_LEN}}}\.[0-9]{{1,10}}\.[0-9a-f]{{{TEMP_RAND_HEX_LEN}}}"
                       rf"{re.escape(TEMP_SUFFIX)}")
PENDING_NAME = re.compile(rf"\.[0-9a-f]{{{KEY_HEX_LEN}}}{re.escape(PENDING_SUFFIX)}")
# safetensors caps the header at 100 MB; ours is a few hundred bytes.
MAX_HEADER_BYTES = 1 << 20
READ_CHUNK_BYTES = 8 << 20  # verify_entry streams the data section in chunks of this size
STALE_RETRIES = 2  # open_entry looks a name up again this often after ESTALE (a network mount)

# safetensors dtype tag -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
TENSOR_ORDER = ("token_ids", "kv", "hidden")
_COUNT = re.compile(r"0|[1-9][0-9]{0,17}")  # identity integers and num_tokens, as str(int) writes them
_CREATED = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")  # Unix seconds, as the writer formats them
_CHECKSUM = re.compile(r"xxh3_128:[0-9a-f]{32}")


class EntryCorrupt(StoreError):
    """The name of an entry holds no complete, valid entry (never served).

    `stat` is what was found there (lstat of a non-regular file, fstat of an
    opened one), when known: `remove_store_file` deletes only that same file,
    and only if it is an entry by the naming rule.
    """

    def __init__(self, path: Path | str, reason: str, stat: os.stat_result | None = None):
        self.path = Path(path)
        self.reason = reason
        self.stat = stat
        super().__init__(f"{self.path.name}: {reason}")


class NameTaken(StoreError):
    """An entry's name is held by something that is not an entry (a directory, FIFO, symlink): never replaced."""


@dataclass(frozen=True)
class KVIdentity:
    """What a KV cache is only valid for: the model, its per-rank layout, TP."""

    model: str
    num_layers: int
    kv_parts: int  # 2 = separate K and V; 1 = MLA latent cache
    kv_heads: int  # per TP rank
    head_size: int
    dtype: str  # safetensors tag of the KV dtype, e.g. "BF16"
    tp_rank: int = 0
    tp_size: int = 1

    def canonical(self) -> bytes:
        return _canonical(self)

    @classmethod
    def from_metadata(cls, meta: dict) -> "KVIdentity":
        """The identity an entry's metadata claims. Raises ValueError for a missing or malformed field.

        Every field is a string as the writer formats it: counts are plain
        decimals (no sign, spaces or underscores), `dtype` a known tag.
        """
        model, dtype = meta.get("model"), meta.get("dtype")
        if not isinstance(model, str):
            raise ValueError(f"identity field model is {_brief(model)}, not a string")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ValueError(f"identity field dtype is {_brief(dtype)}, not one of {' '.join(DTYPE_SIZES)}")
        counts = {name: _count(meta, name) for name in
                  ("num_layers", "kv_parts", "kv_heads", "head_size", "tp_rank", "tp_size")}
        if counts["kv_parts"] not in (1, 2):
            raise ValueError(f"identity field kv_parts is {counts['kv_parts']}, not 1 or 2")
        for name in ("num_layers", "kv_heads", "head_size", "tp_size"):
            if counts[name] < 1:
                raise ValueError(f"identity field {name} is 0")
        if counts["tp_rank"] >= counts["tp_size"]:
            raise ValueError(f"identity tp_rank {counts['tp_rank']} is not below tp_size {counts['tp_size']}")
        return cls(model=model, dtype=dtype, **counts)


@functools.lru_cache(maxsize=64)
def _canonical(identity: KVIdentity) -> bytes:
    """KVIdentity.canonical, computed once per identity (every save and load hashes it)."""
    fields = dict(asdict(identity), format=FORMAT_NAME, version=FORMAT_VERSION)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _count(meta: dict, name: str) -> int:
    value = meta.get(name)
    if not isinstance(value, str) or not _COUNT.fullmatch(value):
        raise ValueError(f"identity field {name} is {_brief(value)}, not a decimal count")
    return int(value)


def _brief(value: object) -> str:
    """A short description of a header value for an error message (never recursive, never huge)."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10 ** 18 else "a huge integer"
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return type(value).__name__


def token_bytes(token_ids: Sequence[int] | Iterable[int]) -> bytes:
    """Token ids as little-endian int64, the form they are hashed and stored in."""
    arr = array("q", token_ids)
    if arr.itemsize != 8:  # pragma: no cover - every CPython platform we run on
        raise RuntimeError("int64 array type unavailable")
    if struct.pack("=i", 1) != struct.pack("<i", 1):  # pragma: no cover - big endian
        arr.byteswap()
    return arr.tobytes()


def compute_key(identity: KVIdentity, token_ids: Sequence[int]) -> str:
    """The entry key: blake2b-128 hex over identity and token ids."""
    return key_from_token_bytes(identity, token_bytes(token_ids))


def _key_hasher(identity: KVIdentity):
    h = hashlib.blake2b(digest_size=KEY_HEX_LEN // 2)
    h.update(identity.canonical())
    h.update(b"\0")
    return h


def key_from_token_bytes(identity: KVIdentity, raw_tokens) -> str:
    """compute_key for token ids already in their stored form (int64 LE bytes)."""
    h = _key_hasher(identity)
    h.update(raw_tokens)
    return h.hexdigest()


def entry_path(root: Path | str, key: str) -> Path:
    return Path(root) / f"{key}{ENTRY_SUFFIX}"


# ---------------------------------------------------------------- what is what in a store

def is_entry_name(name: str) -> bool:
    """`name` has an entry's exact form: 32 lowercase hex digits + `.safetensors`."""
    return ENTRY_NAME.fullmatch(name) is not None


def is_temp_name(name: str) -> bool:
    """`name` has the exact form write_entry gives its temp files: `.<key>.<pid>.<8 hex>.tmp`."""
    return TEMP_NAME.fullmatch(name) is not None


def is_pending_name(name: str) -> bool:
    """`name` has the exact form of a pending marker: `.<key>.pending`."""
    return PENDING_NAME.fullmatch(name) is not None


class FileKind(enum.Enum):
    ENTRY = "entry"  # an entry name holding a regular file
    TEMP = "temp"  # a temp name holding a regular file (a write in progress, or a killed writer's)
    PENDING = "pending"  # a pending marker: a save of that key under way (or a dead writer's leftover)
    LOCK = "lock"  # the bounded store's lock file
    FOREIGN = "foreign"  # anything else: not ours, never touched


def file_kind(name: str, st: os.stat_result) -> FileKind:
    """The one rule for what a name in a store directory is. `st` must come from lstat."""
    if stat_mod.S_ISREG(st.st_mode):
        if is_entry_name(name):
            return FileKind.ENTRY
        if is_temp_name(name):
            return FileKind.TEMP
        if is_pending_name(name):
            return FileKind.PENDING
        if name == LOCK_NAME:
            return FileKind.LOCK
    return FileKind.FOREIGN


@dataclass(frozen=True)
class StoreFile:
    """One name in a store directory, what it is, and its lstat when it was listed."""

    path: Path
    kind: FileKind
    stat: os.stat_result

    @property
    def name(self) -> str:
        return self.path.name


def list_store(root: Path | str) -> list[StoreFile]:
    """Every name in the store directory with its kind, sorted by name (lstat only, nothing opened).

    Raises OSError (FileNotFoundError, NotADirectoryError, PermissionError) when
    `root` cannot be listed; a name that disappears meanwhile is left out.
    """
    found = []
    with os.scandir(root) as it:
        for item in it:
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted or replaced while we looked
            found.append(StoreFile(Path(item.path), file_kind(item.name, st), st))
    found.sort(key=lambda f: f.name)
    return found


def remove_store_file(found: StoreFile, *, unchanged: bool = False) -> bool:
    """Delete an entry, temp file or pending marker, only if its name still holds that same file. The only deleter.

    Refuses (returns False) foreign files and the lock, a name that now holds
    anything but a regular file, another file than the one found (other inode;
    with `unchanged`, also another size or mtime: a producer rewrote it), or
    nothing. Returns True when it removed the file. Raises OSError when the
    unlink itself fails (permissions, a read-only mount).
    """
    if found.kind not in (FileKind.ENTRY, FileKind.TEMP, FileKind.PENDING):
        return False
    try:
        now = os.lstat(found.path)
    except FileNotFoundError:
        return False
    if file_kind(found.name, now) is not found.kind:
        return False
    same = (now.st_dev, now.st_ino) == (found.stat.st_dev, found.stat.st_ino)
    if not same or (unchanged and (now.st_size, now.st_mtime_ns) != (found.stat.st_size, found.stat.st_mtime_ns)):
        return False
    try:
        os.unlink(found.path)
    except FileNotFoundError:
        return False
    return True


# ---------------------------------------------------------------- pending markers

def pending_path(root: Path | str, key: str) -> Path:
    return Path(root) / f".{key}{PENDING_SUFFIX}"


def create_pending(root: Path | str, key: str, *, stale_after_s: float) -> StoreFile | None:
    """Create `key`'s pending marker; returns it when this call created it, else None.

    The marker is an empty file, created exclusively and never through a
    symlink. None: a fresh marker of the key is there already (another save of
    the same prompt is under way; its writer removes it). One older than
    `stale_after_s` (a dead or stuck writer's) is replaced. Raises OSError
    (the store cannot be written), NameTaken when the name holds something
    that is not a regular file (left alone).
    """
    path = pending_path(root, key)
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            there = find_pending(root, key)
            if there is None:
                if os.path.lexists(path):
                    raise NameTaken(f"{path.name} is not a regular file: left alone, no pending marker") from None
                continue  # removed meanwhile: its save ended
            if attempt or pending_age(there) < stale_after_s:
                return None
            remove_store_file(there)
            continue
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return StoreFile(path, FileKind.PENDING, st)
    return None


def find_pending(root: Path | str, key: str) -> StoreFile | None:
    """`key`'s pending marker (lstat only), None when there is none. Raises OSError but a miss."""
    path = pending_path(root, key)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return StoreFile(path, FileKind.PENDING, st) if stat_mod.S_ISREG(st.st_mode) else None


def pending_age(marker: StoreFile, now: float | None = None) -> float:
    """Seconds since the marker was created, by its mtime (negative when the writer's clock is ahead)."""
    return (time.time() if now is None else now) - marker.stat.st_mtime


def _what_is(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISLNK, "a symbolic link"),
                       (stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a character device"), (stat_mod.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


@contextlib.contextmanager
def open_entry(path: Path | str) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """Open the file under an entry name for reading; yields it and its fstat.

    Never follows a symlink, never blocks (a FIFO), never opens anything that
    `lstat` does not show as a regular file. Raises FileNotFoundError (a
    miss), EntryCorrupt when the name holds something else, OSError when the
    file cannot be opened (permissions). An EntryCorrupt raised inside the
    `with` block gets the opened file's stat attached.
    """
    path = Path(path)
    for attempt in range(STALE_RETRIES + 1):
        st = os.lstat(path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise EntryCorrupt(path, f"{_what_is(st)}, not a regular file", stat=st)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            break
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a symlink / socket since the lstat
                raise EntryCorrupt(path, "not a regular file") from None
            # A network mount (NFS, sshfs) whose cached handle names a file replaced or
            # evicted on another host: look the name up again; still stale, it is a miss.
            if e.errno != errno.ESTALE:
                raise
            if attempt == STALE_RETRIES:
                raise FileNotFoundError(errno.ENOENT, "entry replaced or removed on another host while "
                                                      "opening it (stale file handle)", str(path)) from None
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise EntryCorrupt(path, f"{_what_is(st)}, not a regular file", stat=st)
        yield f, st
    except EntryCorrupt as e:
        if e.stat is None:
            e.stat = st
        raise
    finally:
        f.close()


def checksum(buffers: Iterable) -> str:
    """xxh3-128 over the buffers in order, as 'xxh3_128:<hex>'."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return "xxh3_128:" + h.hexdigest()


# ---------------------------------------------------------------- writing

@dataclass
class TensorBlob:
    """One tensor to write: its safetensors dtype tag, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: object  # any C-contiguous buffer (bytes, memoryview, numpy array)

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes


def build_header(identity: KVIdentity, blobs: dict[str, TensorBlob], data_checksum: str,
                 created: float | None = None, mac: str | None = None) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for an entry.

    The same bytes as `json.dumps(header, separators=(",", ":"))` of the
    records and `__metadata__` (identity fields, format, version, num_tokens,
    checksum, created, and `mac` when given), built from a per-identity
    prefix: a save's fixed cost.
    """
    parts = []
    offset = 0
    for name in TENSOR_ORDER:
        blob = blobs[name]
        nbytes = blob.nbytes
        expected = DTYPE_SIZES[blob.dtype]
        for dim in blob.shape:
            expected *= dim
        if expected != nbytes:
            raise ValueError(f"tensor {name}: {nbytes} bytes for shape {blob.shape} {blob.dtype}")
        shape = ",".join(str(int(d)) for d in blob.shape)
        parts.append(f'"{name}":{{"dtype":"{blob.dtype}","shape":[{shape}],'
                     f'"data_offsets":[{offset},{offset + nbytes}]}}')
        offset += nbytes
    stamp = f"{created if created is not None else time.time():.3f}"
    fields = {"num_tokens": str(blobs["token_ids"].shape[0]), "checksum": data_checksum, "created": stamp}
    if mac is not None:
        fields[auth.MAC_FIELD] = mac
    tail = json.dumps(fields, separators=(",", ":"))
    raw = ("{" + ",".join(parts) + ',"__metadata__":' + _identity_meta_prefix(identity)
           + "," + tail[1:] + "}").encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes


@functools.lru_cache(maxsize=64)
def _identity_meta_prefix(identity: KVIdentity) -> str:
    """`{"model":...,"tp_size":"1","format":...,"version":"1"` (no closing brace), once per identity."""
    meta = {k: str(v) for k, v in asdict(identity).items()}
    meta.update(format=FORMAT_NAME, version=str(FORMAT_VERSION))
    return json.dumps(meta, separators=(",", ":"))[:-1]


class PublishGuard(Protocol):
    """Hooks a bounded store puts around a write (connectors.store.eviction.BoundedPublish)."""

    def before_write(self, nbytes: int) -> None: ...

    def publishing(self, nbytes: int, final: str) -> ContextManager[object]: ...


def entry_mode(root: Path | str) -> int:
    """The permission bits the store directory's policy gives its entries and temp files.

    The owner reads and writes; the group reads when the directory lets the
    group in (x), others read when it lets others in. The umask is not applied:
    a shared store (a group, a setgid directory: entries then get its group)
    stays readable by the group's readers whatever the writer's umask, and a
    directory closed to others keeps its entries closed. Nobody but the owner
    may write an entry (a new entry is a new file, renamed in). Raises OSError.
    """
    mode = stat_mod.S_IMODE(os.stat(root).st_mode)
    return 0o600 | (0o040 if mode & 0o010 else 0) | (0o004 if mode & 0o001 else 0)


def write_entry(root: Path | str, key: str, identity: KVIdentity, blobs: dict[str, TensorBlob],
                *, fsync: bool = True, guard: PublishGuard | None = None,
                keys: auth.StoreKeys | None = None, mode: int | None = None) -> Path:
    """Publish an entry atomically; returns its final path.

    With `keys`, the entry carries a tag made with the first key (auth).
    The temp file (and so the entry) gets `mode` from its creation on
    (default: `entry_mode(root)`, the directory's policy).

    The entry is written (and with `fsync`, fsync'ed) under a fresh temp name
    first (created exclusively, never through a symlink), then renamed. A
    `guard` is told the entry's exact size before the write and is entered
    around the rename (a bounded store locks the directory and makes room).
    Raises OSError (ENOSPC, EIO, ...), NameTaken when the entry's name holds
    something that is not a regular file (it is left alone), or what the
    guard raises, after removing the temp file; a partial entry is never
    visible under the final name.

    Fixed costs are kept to the syscalls the safety needs: open(O_EXCL), one
    pwritev of header + data, fsync when asked, an lstat of the final name,
    rename. The directory is not fsync'ed: the file's data is durable before
    its name appears (fsync before rename), so a crash can lose the newest
    publish (a miss) but never leave a torn entry.
    """
    root_s = os.fspath(root)
    ordered = [memoryview(blobs[n].data).cast("B") for n in TENSOR_ORDER]
    if keys is None:
        header = build_header(identity, blobs, checksum(ordered))
    else:
        signer = keys.signer
        mac = auth.hasher(signer)
        for buf in ordered:
            mac.update(buf)
        header = auth.sign_header(signer, mac, build_header(identity, blobs, checksum(ordered),
                                                            mac=auth.blank_mac_value(signer)))
    final = f"{root_s}/{key}{ENTRY_SUFFIX}"
    size = 8 + len(header) + sum(buf.nbytes for buf in ordered)
    if guard is not None:
        guard.before_write(size)
    tmp = f"{root_s}/.{key}.{os.getpid()}.{secrets.token_hex(TEMP_RAND_HEX_LEN // 2)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, entry_mode(root_s) if mode is None else mode)  # the umask does not decide
            _write_all(fd, [struct.pack("<Q", len(header)) + header, *ordered], 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        with guard.publishing(size, final) if guard is not None else contextlib.nullcontext():
            _check_name_free(final)
            os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return Path(final)


def _write_all(fd: int, buffers: list, offset: int) -> None:
    """pwritev every byte of `buffers` at `offset` (a regular file writes less only on a signal or ENOSPC)."""
    bufs = [b for b in buffers if len(b)]
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:  # pragma: no cover - a regular file either writes or raises
            raise OSError(errno.EIO, "write returned 0")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = memoryview(bufs[0]).cast("B")[n:]


def _check_name_free(final: str) -> None:
    """An entry may replace an entry (same key, same content); nothing else is replaced."""
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return
    if not stat_mod.S_ISREG(st.st_mode):
        raise NameTaken(f"{os.path.basename(final)} is {_what_is(st)}, not an entry: left alone, entry not published")


# ---------------------------------------------------------------- reading

@dataclass
class EntryHeader:
    """A parsed, checked entry header: where each tensor lies and what the entry claims.

    Only `parse_header` builds one; every field has been checked (types,
    spans, shapes against the identity), so using it cannot raise.
    """

    path: Path
    header_len: int
    raw: bytes  # the header's JSON bytes as stored (a tag covers them)
    tensors: dict[str, dict]  # the three tensor records, by name
    metadata: dict[str, str]
    file_size: int
    identity: KVIdentity
    num_tokens: int
    created: float

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start

    @property
    def checksum(self) -> str:
        return self.metadata["checksum"]

    @property
    def hidden_tokens(self) -> int:
        return self.tensors["hidden"]["shape"][0]

    def tag_check(self, keys: auth.StoreKeys) -> auth.TagCheck:
        """Start checking this entry's tag (auth.start_check): raises EntryUnauthenticated."""
        return auth.start_check(self.path, self.metadata, self.raw, keys)

    def span(self, name: str) -> tuple[int, int]:
        begin, end = self.tensors[name]["data_offsets"]
        return begin, end


def parse_header(path: Path | str, f: BinaryIO | None = None) -> EntryHeader:
    """Read and check an entry's header (rules 1-4 and 10 of the spec), not its data.

    `f` is the open entry (from `open_entry`), read from its start. Raises
    FileNotFoundError (a miss), EntryCorrupt (anything wrong, whatever the
    header holds), OSError (the file cannot be read).
    """
    path = Path(path)
    if f is None:
        with open_entry(path) as (opened, _):
            return parse_header(path, opened)
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise EntryCorrupt(path, f"file is {size} bytes, shorter than a safetensors header")
    (hlen,) = struct.unpack("<Q", head)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise EntryCorrupt(path, f"header length {hlen} does not fit a {size}-byte file")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise EntryCorrupt(path, f"short header read: {len(raw)} of {hlen} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as e:  # also bad UTF-8, and integers too long to convert
        raise EntryCorrupt(path, f"header is not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise EntryCorrupt(path, "header JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise EntryCorrupt(path, f"header is {_brief(doc)}, not a JSON object")
    meta = doc.get("__metadata__")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise EntryCorrupt(path, f"__metadata__ is {_brief(meta)}, not a JSON object")
    if meta.get("format") != FORMAT_NAME:
        raise EntryCorrupt(path, f"not a {FORMAT_NAME} entry (format={_brief(meta.get('format'))})")
    if meta.get("version") != str(FORMAT_VERSION):
        raise EntryCorrupt(path, f"format version {_brief(meta.get('version'))}, this reader knows {FORMAT_VERSION}")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise EntryCorrupt(path, f"metadata {_brief(key)} is {_brief(value)}; metadata holds strings only")
    missing = [n for n in TENSOR_ORDER if n not in doc]
    if missing:
        raise EntryCorrupt(path, f"missing tensors: {', '.join(missing)}")
    tensors = {n: doc[n] for n in TENSOR_ORDER}
    _check_records(path, tensors)
    try:
        identity = KVIdentity.from_metadata(meta)
    except ValueError as e:
        raise EntryCorrupt(path, str(e)) from None
    num_tokens, created = _check_metadata(path, meta)
    _check_shapes(path, tensors, identity, num_tokens)
    entry = EntryHeader(path=path, header_len=hlen, raw=raw, tensors=tensors, metadata=meta, file_size=size,
                        identity=identity, num_tokens=num_tokens, created=created)
    end = entry.span(TENSOR_ORDER[-1])[1]
    if end != entry.data_len:
        raise EntryCorrupt(path, f"data section is {entry.data_len} bytes, header describes {end}")
    return entry


def _check_records(path: Path, tensors: dict) -> None:
    """Each tensor record has a known dtype, a shape of counts and the next span of the data section."""
    offset = 0
    for name in TENSOR_ORDER:
        rec = tensors[name]
        if not isinstance(rec, dict):
            raise EntryCorrupt(path, f"tensor {name}: record is {_brief(rec)}, not a JSON object")
        dtype, shape, span = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise EntryCorrupt(path, f"tensor {name}: dtype is {_brief(dtype)}, not a safetensors dtype tag")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise EntryCorrupt(path, f"tensor {name}: shape is {_brief(shape)}, not a list of counts")
        if (not isinstance(span, list) or len(span) != 2
                or not all(type(o) is int for o in span)):
            raise EntryCorrupt(path, f"tensor {name}: data_offsets is {_brief(span)}, not two integers")
        nbytes = DTYPE_SIZES[dtype] * math.prod(shape)
        if span != [offset, offset + nbytes]:
            raise EntryCorrupt(path, f"tensor {name}: data_offsets [{_brief(span[0])}, {_brief(span[1])}], "
                                     f"expected [{offset}, {offset + nbytes}]")
        offset += nbytes


def _check_metadata(path: Path, meta: dict) -> tuple[int, float]:
    """num_tokens, checksum and created are there and well-formed; returns (num_tokens, created)."""
    num_tokens, check, created = meta.get("num_tokens"), meta.get("checksum"), meta.get("created", "0")
    if num_tokens is None or check is None:
        raise EntryCorrupt(path, "metadata lacks num_tokens or checksum")
    if not _COUNT.fullmatch(num_tokens):
        raise EntryCorrupt(path, f"metadata num_tokens is {_brief(num_tokens)}, not a decimal count")
    if not _CHECKSUM.fullmatch(check):
        raise EntryCorrupt(path, f"metadata checksum is {_brief(check)}, not xxh3_128:<32 hex digits>")
    if not _CREATED.fullmatch(created):
        raise EntryCorrupt(path, f"metadata created is {_brief(created)}, not Unix seconds")
    return int(num_tokens), float(created)


def _check_shapes(path: Path, tensors: dict, identity: KVIdentity, num_tokens: int) -> None:
    """Rule 10: the tensors are what the identity and num_tokens say (a crafted kv never reaches a cache)."""
    if num_tokens <= 0:
        raise EntryCorrupt(path, f"num_tokens is {num_tokens}")
    expected = {
        "token_ids": ("I64", [num_tokens]),
        "kv": (identity.dtype, [identity.num_layers, identity.kv_parts, num_tokens, identity.kv_heads,
                                identity.head_size]),
    }
    for name, (dtype, shape) in expected.items():
        rec = tensors[name]
        if rec["dtype"] != dtype or rec["shape"] != shape:
            raise EntryCorrupt(path, f"tensor {name} is {rec['dtype']} {_shape(rec['shape'])}, "
                                     f"the header's identity says {dtype} {_shape(shape)}")
    hidden = tensors["hidden"]["shape"]
    if len(hidden) != 2 or not 1 <= hidden[0] <= num_tokens:
        raise EntryCorrupt(path, f"tensor hidden has shape {_shape(hidden)}, want [1..{num_tokens}, hidden_size]")


def _shape(shape: list) -> str:
    return f"[{', '.join(map(str, shape[:8]))}{', ...' if len(shape) > 8 else ''}]"


def read_data(path: Path | str, f: BinaryIO, header: EntryHeader, into=None,
              keys: auth.StoreKeys | None = None) -> memoryview:
    """Read an entry's whole data section (after `parse_header` on the same `f`); check checksum and key.

    `into(nbytes)` may return a writable buffer to read into (the torch store
    passes a uint8 tensor's memory, avoiding a copy); the caller checks that
    the header's size is what it expects before calling this. With `keys`,
    the tag is checked first (header) and last (data). Raises
    EntryUnauthenticated (keys: unsigned, bad signature), EntryCorrupt
    (short read, checksum, key), OSError.
    """
    path = Path(path)
    tag = header.tag_check(keys) if keys is not None else None
    n = header.data_len
    buf = into(n) if into is not None else bytearray(n)
    view = memoryview(buf).cast("B")
    got = _read_into(f, view)
    if got != n:
        raise EntryCorrupt(path, f"short read: {got} of {n} data bytes")
    if checksum([view]) != header.checksum:
        raise EntryCorrupt(path, "checksum mismatch: data does not match the checksum in the header")
    if tag is not None:  # after the checksum: a damaged entry is corrupt, a forged one (right checksum) is not
        tag.update(view)
        tag.finish()
    begin, end = header.span("token_ids")
    expected_key = key_from_token_bytes(header.identity, view[begin:end])
    if path.name != f"{expected_key}{ENTRY_SUFFIX}":
        raise EntryCorrupt(path, f"content hashes to key {expected_key}, not the file name")
    return view


def _read_into(f: BinaryIO, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def read_entry(path: Path | str, into=None, keys: auth.StoreKeys | None = None) -> tuple[EntryHeader, memoryview]:
    """Read a whole entry and check it (rules 1-7, 10). Holds the whole data section in memory.

    Raises FileNotFoundError for a miss, EntryCorrupt for anything invalid,
    OSError when it cannot be read; with `keys`, EntryUnauthenticated. Checking
    a store without trusting sizes: `verify_entry`.
    """
    path = Path(path)
    with open_entry(path) as (f, _):
        header = parse_header(path, f)
        return header, read_data(path, f, header, into, keys)


def verify_entry(path: Path | str, keys: auth.StoreKeys | None = None) -> EntryHeader:
    """Check an entry completely (rules 1-7, 10, 11; with `keys`, 12) in bounded memory; returns its header.

    Raises FileNotFoundError, EntryUnauthenticated (keys), EntryCorrupt, OSError.
    """
    path = Path(path)
    with open_entry(path) as (f, _):
        header = parse_header(path, f)
        verify_data(path, f, header, keys)
    return header


def verify_data(path: Path | str, f: BinaryIO, header: EntryHeader, keys: auth.StoreKeys | None = None) -> None:
    """Check an entry's data section (after `parse_header` on the same `f`): rules 5-7 and 11.

    The data is streamed in READ_CHUNK_BYTES chunks, never allocated whole,
    whatever size the header claims; holes of a sparse file are hashed as the
    zeros they read as, without reading them. The key (from the token ids, at
    the start of the data) is checked before the rest is read, so a renamed or
    re-headered file fails fast. With `keys`, the tag is checked too (rule
    12): an unsigned entry before any data is read, the tag at the end, after
    the checksum (a damaged entry is corrupt; a forged one, whose checksum is
    right, is a bad signature).
    Raises EntryUnauthenticated, EntryCorrupt, OSError.
    """
    path = Path(path)
    tag = header.tag_check(keys) if keys is not None else None
    _, tokens_end = header.span("token_ids")
    data_hash, key_hash = xxhash.xxh3_128(), _key_hasher(header.identity)
    negative, first_negative = 0, 0
    pos, rest = 0, b""  # rest: the tail of a token id split across chunks
    for chunk in _data_chunks(path, f, header.data_start, header.data_len, tokens_end):
        data_hash.update(chunk)
        if tag is not None:
            tag.update(chunk)
        if pos < tokens_end:
            key_hash.update(chunk)
            raw = rest + bytes(chunk) if rest else chunk
            whole = len(raw) - len(raw) % 8
            ids = array("q")  # token ids are int64 little-endian
            ids.frombytes(raw[:whole])
            rest = bytes(raw[whole:])
            if struct.pack("=i", 1) != struct.pack("<i", 1):  # pragma: no cover - big endian
                ids.byteswap()
            if ids and min(ids) < 0:
                if not negative:
                    first_negative = next(t for t in ids if t < 0)
                negative += sum(1 for t in ids if t < 0)
        pos += len(chunk)
        if pos == tokens_end and path.name != f"{key_hash.hexdigest()}{ENTRY_SUFFIX}":
            raise EntryCorrupt(path, f"content hashes to key {key_hash.hexdigest()}, not the file name")
    if "xxh3_128:" + data_hash.hexdigest() != header.checksum:
        raise EntryCorrupt(path, "checksum mismatch: data does not match the checksum in the header")
    if tag is not None:
        tag.finish()
    if negative:
        raise EntryCorrupt(path, f"{negative} negative token ids (first: {first_negative})")


def _data_chunks(path: Path, f: BinaryIO, start: int, total: int, boundary: int) -> Iterator[memoryview]:
    """Bytes [start, start + total) of `f` in chunks of at most READ_CHUNK_BYTES, none crossing `boundary`.

    A hole (SEEK_DATA/SEEK_HOLE, where the filesystem has them) is yielded
    from a zero buffer instead of being read. Each chunk is valid until the
    next one is asked for. Raises EntryCorrupt on a short read.
    """
    fd = f.fileno()
    size = min(READ_CHUNK_BYTES, total)
    buf, zeros = bytearray(size), None
    pos, hole_end, data_end = 0, 0, 0  # [pos, hole_end) reads as zeros, [hole_end, data_end) is data
    while pos < total:
        if pos >= data_end:
            hole_end, data_end = _next_data(fd, start, pos, total)
        limit = boundary if pos < boundary else total
        if pos < hole_end:
            n = min(size, hole_end - pos, limit - pos)
            if zeros is None:
                zeros = bytes(size)
            yield memoryview(zeros)[:n]
        else:
            n = min(size, data_end - pos, limit - pos)
            view = memoryview(buf)[:n]
            got = os.preadv(fd, [view], start + pos)
            while 0 < got < n:  # a regular file returns less only at its end (or on a signal)
                more = os.preadv(fd, [view[got:]], start + pos + got)
                if not more:
                    break
                got += more
            if got != n:
                raise EntryCorrupt(path, f"short read: {pos + got} of {total} data bytes")
            yield view
        pos += n


def _next_data(fd: int, start: int, pos: int, total: int) -> tuple[int, int]:
    """(where the data after the hole at `pos` begins, where that data ends), relative to `start`.

    No hole at `pos`: (pos, end of its data). Where the filesystem does not
    report holes: (pos, total), everything is read.
    """
    try:
        data = os.lseek(fd, start + pos, os.SEEK_DATA) - start
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data up to the end of the file: a hole, or a file cut short
            return total, total
        return pos, total  # EINVAL: the filesystem has no SEEK_DATA
    if data >= total:
        return total, total
    try:
        hole = os.lseek(fd, start + data, os.SEEK_HOLE) - start
    except OSError:
        hole = total
    return data, max(data + 1, min(hole, total))


def token_ids_of(header: EntryHeader, data: memoryview) -> list[int]:
    begin, end = header.span("token_ids")
    arr = array("q")
    arr.frombytes(bytes(data[begin:end]))
    if struct.pack("=i", 1) != struct.pack("<i", 1):  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


@dataclass
class ScanResult:
    """Everything found in a store directory, sorted into what it is (by `file_kind`)."""

    root: Path
    entries: list[EntryHeader] = field(default_factory=list)
    corrupt: list[EntryCorrupt] = field(default_factory=list)
    unreadable: list[Path] = field(default_factory=list)  # entries this process may not read
    temp_files: list[Path] = field(default_factory=list)
    pending: list[Path] = field(default_factory=list)  # pending markers: saves under way (or stale)
    foreign: list[Path] = field(default_factory=list)


def scan_store(root: Path | str) -> ScanResult:
    """Classify every name in a store directory; entries by their header (data not read).

    Raises OSError (FileNotFoundError / NotADirectoryError, ...) for a bad root.
    """
    root = Path(root)
    result = ScanResult(root=root)
    for found in list_store(root):
        if found.kind is FileKind.TEMP:
            result.temp_files.append(found.path)
        elif found.kind is FileKind.PENDING:
            result.pending.append(found.path)
        elif found.kind is FileKind.FOREIGN:
            result.foreign.append(found.path)
        elif found.kind is FileKind.ENTRY:
            try:
                result.entries.append(parse_header(found.path))
            except EntryCorrupt as e:
                result.corrupt.append(e)
            except FileNotFoundError:
                continue  # evicted or replaced while we looked
            except OSError:
                result.unreadable.append(found.path)
    return result
