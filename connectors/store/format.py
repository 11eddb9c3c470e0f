"""On-disk format of the FS KV store, version 1 (spec: docs/store-format.md).

This module is the only place that knows the format. It imports neither torch
nor vLLM, so `kvctl inspect-store` can read and check a store anywhere.

Layout of a store directory::

    <root>/<key>.safetensors          one published entry (prompt x TP rank)
    <root>/.<key>.<pid>.<rand>.tmp     an entry being written (never read)
    <root>/.kvctl-store.lock           flock for publish + eviction (bounded stores)

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
went into the key, and an xxh3-128 checksum of the whole data section.

Key: blake2b-128 over the identity (model, layers, kv_parts, kv_heads,
head_size, dtype, tp_rank, tp_size, format version) and the token ids. A reader
recomputes the key from the entry's own tokens and identity: an entry whose
name does not match its content is corrupt, and one whose tokens differ from
the prompt is never served.

Entries are published atomically: written to a temp name in the same
directory, fsync'ed (configurable), then renamed over the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, ContextManager, Iterable, Protocol, Sequence

import xxhash

FORMAT_NAME = "kvctl-fs-kv"
FORMAT_VERSION = 1
ENTRY_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".kvctl-store.lock"  # serialises publish + eviction in bounded stores
KEY_HEX_LEN = 32  # 128-bit keys
# safetensors caps the header at 100 MB; ours is a few hundred bytes.
MAX_HEADER_BYTES = 1 << 20

# safetensors dtype tag -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
TENSOR_ORDER = ("token_ids", "kv", "hidden")


class StoreError(Exception):
    """Root of everything this module raises about a store or an entry."""


class EntryCorrupt(StoreError):
    """The file exists but is not a complete, valid entry (never served)."""

    def __init__(self, path: Path | str, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path.name}: {reason}")


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
        fields = dict(asdict(self), format=FORMAT_NAME, version=FORMAT_VERSION)
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "KVIdentity":
        try:
            return cls(
                model=meta["model"],
                num_layers=int(meta["num_layers"]),
                kv_parts=int(meta["kv_parts"]),
                kv_heads=int(meta["kv_heads"]),
                head_size=int(meta["head_size"]),
                dtype=meta["dtype"],
                tp_rank=int(meta["tp_rank"]),
                tp_size=int(meta["tp_size"]),
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"identity field missing or malformed: {e}") from e


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


def key_from_token_bytes(identity: KVIdentity, raw_tokens) -> str:
    """compute_key for token ids already in their stored form (int64 LE bytes)."""
    h = hashlib.blake2b(digest_size=KEY_HEX_LEN // 2)
    h.update(identity.canonical())
    h.update(b"\0")
    h.update(raw_tokens)
    return h.hexdigest()


def entry_path(root: Path | str, key: str) -> Path:
    return Path(root) / f"{key}{ENTRY_SUFFIX}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def checksum(buffers: Iterable) -> str:
    """xxh3-128 over the buffers in order, as 'xxh3_128:<hex>'."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return "xxh3_128:" + h.hexdigest()


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
                 created: float | None = None) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for an entry."""
    header: dict[str, object] = {}
    offset = 0
    for name in TENSOR_ORDER:
        blob = blobs[name]
        expected = DTYPE_SIZES[blob.dtype]
        for dim in blob.shape:
            expected *= dim
        if expected != blob.nbytes:
            raise ValueError(f"tensor {name}: {blob.nbytes} bytes for shape {blob.shape} {blob.dtype}")
        header[name] = {"dtype": blob.dtype, "shape": list(blob.shape),
                        "data_offsets": [offset, offset + blob.nbytes]}
        offset += blob.nbytes
    meta = {k: str(v) for k, v in asdict(identity).items()}
    meta.update(format=FORMAT_NAME, version=str(FORMAT_VERSION),
                num_tokens=str(blobs["token_ids"].shape[0]), checksum=data_checksum,
                created=f"{created if created is not None else time.time():.3f}")
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return raw


class PublishGuard(Protocol):
    """Hooks a bounded store puts around a write (connectors.store.eviction.BoundedPublish)."""

    def before_write(self, nbytes: int) -> None: ...

    def publishing(self, nbytes: int) -> ContextManager[object]: ...


def write_entry(root: Path | str, key: str, identity: KVIdentity, blobs: dict[str, TensorBlob],
                *, fsync: bool = True, guard: PublishGuard | None = None) -> Path:
    """Publish an entry atomically; returns its final path.

    The entry is written and fsync'ed under a temp name first, then renamed.
    A `guard` is told the entry's exact size before the write and is entered
    around the rename (a bounded store locks the directory and makes room).
    Raises OSError (ENOSPC, EIO, ...) or what the guard raises, after
    removing the temp file; a partial entry is never visible under the final name.
    """
    root = Path(root)
    ordered = [memoryview(blobs[n].data).cast("B") for n in TENSOR_ORDER]
    header = build_header(identity, blobs, checksum(ordered))
    final = entry_path(root, key)
    size = 8 + len(header) + sum(buf.nbytes for buf in ordered)
    if guard is not None:
        guard.before_write(size)
    tmp = root / f".{key}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for buf in ordered:
                f.write(buf)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        with guard.publishing(size) if guard is not None else contextlib.nullcontext():
            os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        _fsync_dir(root)
    return final


def _fsync_dir(root: Path) -> None:
    # Makes the rename itself durable; a no-op where directories can't be opened.
    try:
        fd = os.open(root, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class EntryHeader:
    """A parsed entry header: where each tensor lies and what the entry claims."""

    path: Path
    header_len: int
    tensors: dict[str, dict]
    metadata: dict[str, str]
    file_size: int
    identity: KVIdentity = field(init=False)

    def __post_init__(self) -> None:
        self.identity = KVIdentity.from_metadata(self.metadata)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start

    @property
    def num_tokens(self) -> int:
        return int(self.metadata["num_tokens"])

    @property
    def created(self) -> float:
        return float(self.metadata.get("created", "0"))

    @property
    def checksum(self) -> str:
        return self.metadata["checksum"]

    def span(self, name: str) -> tuple[int, int]:
        begin, end = self.tensors[name]["data_offsets"]
        return int(begin), int(end)


def parse_header(path: Path | str, f: BinaryIO | None = None) -> EntryHeader:
    """Read and check an entry's header (not its data). Raises EntryCorrupt."""
    path = Path(path)
    own = f is None
    if own:
        f = open(path, "rb")
    try:
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
    finally:
        if own:
            f.close()
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise EntryCorrupt(path, f"header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise EntryCorrupt(path, "header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise EntryCorrupt(path, "__metadata__ is not a JSON object")
    if meta.get("format") != FORMAT_NAME:
        raise EntryCorrupt(path, f"not a {FORMAT_NAME} entry (format={meta.get('format')!r})")
    if meta.get("version") != str(FORMAT_VERSION):
        raise EntryCorrupt(path, f"format version {meta.get('version')!r}, this reader knows {FORMAT_VERSION}")
    missing = [n for n in TENSOR_ORDER if n not in doc]
    if missing:
        raise EntryCorrupt(path, f"missing tensors: {', '.join(missing)}")
    _check_records(path, doc, meta)
    try:
        entry = EntryHeader(path=path, header_len=hlen, tensors=doc, metadata=meta, file_size=size)
    except ValueError as e:
        raise EntryCorrupt(path, str(e)) from None
    end = max(entry.span(n)[1] for n in TENSOR_ORDER)
    if end != entry.data_len:
        raise EntryCorrupt(path, f"data section is {entry.data_len} bytes, header describes {end}")
    return entry


def _check_records(path: Path, doc: dict, meta: dict) -> None:
    """Every field the readers index is there with the right type (else EntryCorrupt).

    A damaged header must read as corrupt, never as a KeyError or TypeError
    in the middle of a request.
    """
    for key in ("num_tokens", "checksum", "created"):
        if not isinstance(meta.get(key, "0"), str):
            raise EntryCorrupt(path, f"metadata {key} is not a string")
    if "checksum" not in meta or "num_tokens" not in meta:
        raise EntryCorrupt(path, "metadata lacks num_tokens or checksum")
    try:
        int(meta["num_tokens"]), float(meta.get("created", "0"))
    except ValueError:
        raise EntryCorrupt(path, "metadata num_tokens or created is not a number") from None
    offset = 0
    for name in TENSOR_ORDER:
        rec = doc[name]
        shape = rec.get("shape") if isinstance(rec, dict) else None
        span = rec.get("data_offsets") if isinstance(rec, dict) else None
        if (not isinstance(rec, dict) or rec.get("dtype") not in DTYPE_SIZES
                or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(span, list) or len(span) != 2 or not all(type(o) is int for o in span)):
            raise EntryCorrupt(path, f"tensor {name}: malformed record {rec!r:.120}")
        nbytes = DTYPE_SIZES[rec["dtype"]]
        for dim in shape:
            nbytes *= dim
        if span != [offset, offset + nbytes]:
            raise EntryCorrupt(path, f"tensor {name}: data_offsets {span}, expected {[offset, offset + nbytes]}")
        offset += nbytes


def read_entry(path: Path | str, into=None) -> tuple[EntryHeader, memoryview]:
    """Read a whole entry and check its checksum and key.

    `into(nbytes)` may return a writable buffer to read the data section into
    (the torch store passes a uint8 tensor's memory, avoiding a copy).
    Raises FileNotFoundError for a miss, EntryCorrupt for anything invalid.
    """
    path = Path(path)
    with open(path, "rb") as f:
        header = parse_header(path, f)
        n = header.data_len
        buf = into(n) if into is not None else bytearray(n)
        view = memoryview(buf).cast("B")
        got = f.readinto(view)
        if got != n:
            raise EntryCorrupt(path, f"short read: {got} of {n} data bytes")
    if checksum([view]) != header.checksum:
        raise EntryCorrupt(path, "checksum mismatch: data does not match the checksum in the header")
    begin, end = header.span("token_ids")
    expected_key = key_from_token_bytes(header.identity, view[begin:end])
    if path.name != f"{expected_key}{ENTRY_SUFFIX}":
        raise EntryCorrupt(path, f"content hashes to key {expected_key}, not the file name")
    return header, view


def token_ids_of(header: EntryHeader, data: memoryview) -> list[int]:
    begin, end = header.span("token_ids")
    arr = array("q")
    arr.frombytes(bytes(data[begin:end]))
    if struct.pack("=i", 1) != struct.pack("<i", 1):  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


@dataclass
class ScanResult:
    """Everything found in a store directory, sorted into what it is."""

    root: Path
    entries: list[EntryHeader] = field(default_factory=list)
    corrupt: list[EntryCorrupt] = field(default_factory=list)
    temp_files: list[Path] = field(default_factory=list)
    foreign: list[Path] = field(default_factory=list)


def scan_store(root: Path | str) -> ScanResult:
    """Classify every file in a store directory by its header (data not read).

    Raises FileNotFoundError / NotADirectoryError for a bad root.
    """
    root = Path(root)
    result = ScanResult(root=root)
    for item in sorted(root.iterdir()):
        name = item.name
        if name == LOCK_NAME:
            continue
        if is_temp_name(name):
            result.temp_files.append(item)
        elif name.endswith(ENTRY_SUFFIX) and len(name) == KEY_HEX_LEN + len(ENTRY_SUFFIX):
            try:
                result.entries.append(parse_header(item))
            except EntryCorrupt as e:
                result.corrupt.append(e)
            except FileNotFoundError:
                continue  # evicted or replaced while we looked
        else:
            result.foreign.append(item)
    return result
