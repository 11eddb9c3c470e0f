"""Save and load KV entries as torch tensors (format: connectors.store.format).

The torch half of the store: turns tensors into the format's byte buffers
without extra copies, and reads an entry straight into a uint8 tensor whose
memory the KV and hidden-state tensors then view.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import torch
import xxhash

from connectors.store import auth, format as fmt
from connectors.store.eviction import BoundedPublish

logger = logging.getLogger(__name__)

TORCH_TO_TAG = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TAG_TO_TORCH = {v: k for k, v in TORCH_TO_TAG.items()}
STAGING_MIN_BYTES = 1 << 20  # load_into's per-thread staging buffer starts at this size
LOAD_CHUNK_BYTES = 4 << 20  # load_into reads whole layers, as many as fit in this (at least one)


def dtype_tag(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TAG[dtype]
    except KeyError:
        raise ValueError(f"KV dtype {dtype} has no safetensors tag") from None


def _blob(t: torch.Tensor) -> fmt.TensorBlob:
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    # A uint8 view gives a buffer for every dtype (numpy has no bfloat16).
    raw = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""
    return fmt.TensorBlob(dtype_tag(t.dtype), tuple(t.shape), raw)


class TokenMismatch(fmt.StoreError):
    """An entry exists under the key but holds other tokens (never served)."""


@dataclass
class SaveResult:
    key: str
    path: Path
    num_bytes: int
    seconds: float


@dataclass
class LoadedEntry:
    key: str
    kv: torch.Tensor | None  # [layers, kv_parts, tokens, kv_heads, head_size]; None from load_into
    hidden: torch.Tensor  # [tokens, hidden_size]
    num_bytes: int
    seconds: float


class FSStore:
    """One store directory. Thread-safe: every call works on its own files.

    With `keys` (connectors.store.auth), every entry saved is signed with the
    first key, and only entries signed with one of them are loaded (others
    raise EntryUnauthenticated and are left where they are).
    """

    def __init__(self, root: Path | str, *, fsync: bool = True, max_bytes: int | None = None,
                 ttl_seconds: float | None = None, keys: auth.StoreKeys | None = None):
        self.root = Path(root)
        self.fsync = fsync
        self.keys = keys
        self._mode: int | None = None  # entries' permission bits (format.entry_mode), at the first save
        self._local = threading.local()  # load_into's staging buffer, one per thread
        bounded = max_bytes is not None or ttl_seconds is not None
        self.guard = BoundedPublish(self.root, max_bytes, ttl_seconds) if bounded else None

    def key_for(self, identity: fmt.KVIdentity, token_ids: Sequence[int]) -> str:
        return fmt.compute_key(identity, token_ids)

    def save(self, identity: fmt.KVIdentity, token_ids: Sequence[int], kv: torch.Tensor,
             hidden: torch.Tensor) -> SaveResult:
        """Publish one entry atomically (evicting LRU entries first in a bounded store).

        Raises OSError on I/O failure and EntryTooLarge for an entry bigger
        than max_bytes; nothing is published then.
        """
        start = time.perf_counter()
        if torch.is_tensor(token_ids):
            tokens = _blob(token_ids.to(torch.int64))
        else:
            raw = fmt.token_bytes(token_ids)
            tokens = fmt.TensorBlob("I64", (len(raw) // 8,), raw)
        expected = (identity.num_layers, identity.kv_parts, tokens.shape[0],
                    identity.kv_heads, identity.head_size)
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv shape {list(kv.shape)} != identity's {list(expected)}")
        blobs = {"token_ids": tokens, "kv": _blob(kv), "hidden": _blob(hidden)}
        key = fmt.key_from_token_bytes(identity, blobs["token_ids"].data)
        size = sum(b.nbytes for b in blobs.values())
        try:
            path = self._write(key, identity, blobs)
        except OSError as e:
            # A bounded store may evict its way out of a full disk (the bound
            # can be above the real free space); an unbounded one never deletes.
            if e.errno != errno.ENOSPC or self.guard is None or not self.guard.free(2 * size).removed:
                raise
            logger.warning("store %s: disk full, evicted %d LRU entries and retried",
                           self.root, len(self.guard.last_report.removed))
            path = self._write(key, identity, blobs)
        return SaveResult(key, path, size, time.perf_counter() - start)

    def has_entry(self, key: str) -> bool:
        """An entry with a sound header is published under `key`; it counts as used (LRU).

        Only the header is read: a producer asks this on every repeated prompt.
        Never raises: a damaged or foreign file under the name, or one that
        cannot be read, is "no entry" (the producer publishes it again; a
        damaged data section is found and deleted by the consumer). With
        keys, so is an entry without a tag of an accepted key (its signed
        replacement is published over it); the tag itself is the reader's to
        verify.
        """
        path = fmt.entry_path(self.root, key)
        try:
            with fmt.open_entry(path) as (f, _):
                header = fmt.parse_header(path, f)
                if self.keys is not None and not auth.has_accepted_tag(header.metadata, self.keys):
                    return False
                _touch(f)
        except (OSError, fmt.EntryCorrupt):
            return False
        return True

    def remove_corrupt(self, error: fmt.EntryCorrupt) -> bool:
        """Delete the entry `error` was raised for, so the producer publishes it again.

        Only the file that was found corrupt, and only if it is an entry by the
        format's rule (a FIFO, symlink or directory under an entry's name is
        left alone, as is an entry republished since). Returns whether it was
        removed. Raises OSError when the unlink fails (a read-only mount).
        """
        if error.stat is None:
            return False
        found = fmt.StoreFile(error.path, fmt.file_kind(error.path.name, error.stat), error.stat)
        return fmt.remove_store_file(found, unchanged=True)

    def _write(self, key: str, identity: fmt.KVIdentity, blobs: dict[str, fmt.TensorBlob]) -> Path:
        if self._mode is None:
            self._mode = fmt.entry_mode(self.root)  # once: a publish costs no extra stat
        return fmt.write_entry(self.root, key, identity, blobs, fsync=self.fsync, guard=self.guard, keys=self.keys,
                               mode=self._mode)

    def load(self, identity: fmt.KVIdentity, token_ids: Sequence[int],
             device: torch.device | str = "cpu", *, hidden_size: int | None = None,
             hidden_dtype: torch.dtype | None = None) -> LoadedEntry:
        """Load the entry for exactly these tokens onto `device`.

        Before anything past the header is read or allocated, the entry must
        be exactly what this identity and prompt need: the identity, the
        number of tokens, kv's dtype and shape, and (when given) the hidden
        state's size and dtype. So a crafted or damaged header can neither
        reach the caller's cache with another shape nor make this allocate
        what it claims.

        Raises FileNotFoundError (miss); store_format.EntryCorrupt for every
        malformed entry (damaged, truncated, checksum, foreign, wrong key,
        wrong shapes or dtypes, not a regular file: `remove_corrupt` deletes
        it if it is ours); TokenMismatch (hash collision or tampering: stored
        tokens differ from the prompt); auth.EntryUnauthenticated (with keys:
        unsigned or bad signature; never removed); OSError when the file
        cannot be read (permissions, EIO).
        """
        start = time.perf_counter()
        with self._open_fitting(identity, token_ids, hidden_size, hidden_dtype) as (key, raw_tokens, path, f, header):
            data = torch.empty(header.data_len, dtype=torch.uint8)
            view = fmt.read_data(path, f, header, into=lambda nbytes: data.numpy(), keys=self.keys)
            begin, end = header.span("token_ids")
            if bytes(view[begin:end]) != raw_tokens:
                raise TokenMismatch(f"{path.name}: stored token ids differ from the prompt's")
            _touch(f)  # a hit makes the entry recent for LRU eviction
        kv = self._tensor(header, data, "kv").to(device, non_blocking=True)
        hidden = self._tensor(header, data, "hidden").to(device, non_blocking=True)
        return LoadedEntry(key, kv, hidden, header.data_len, time.perf_counter() - start)

    def load_into(self, identity: fmt.KVIdentity, token_ids: Sequence[int],
                  write_layer: Callable[[int, torch.Tensor], None], *, hidden_size: int | None = None,
                  hidden_dtype: torch.dtype | None = None) -> LoadedEntry:
        """Load the entry for these tokens layer by layer into the caller's cache, in one pass.

        Whole layers (as many as fit in LOAD_CHUNK_BYTES, at least one) are
        read into a staging buffer this store reuses, hashed while still in the
        CPU cache, and each layer's KV ([kv_parts, tokens, kv_heads,
        head_size], valid during the call only) is handed to
        `write_layer(layer, kv)` (which scatters it into the paged cache)
        before the next read: the data crosses memory once on its way from the
        page cache to the paged cache, and no buffer of the entry's size is
        allocated. The returned entry's `kv` is None; `hidden` is a tensor of
        its own.

        The same rules as `load` hold and raise the same errors; the header,
        the identity, the key, the token ids and (with keys) the presence of
        an accepted tag are checked before `write_layer` is first called. The
        checksum and the tag cover the whole data section, so they are known
        only at the end: on EntryCorrupt or EntryUnauthenticated raised after
        `write_layer` ran, what it wrote is not the entry's and must not be
        used (the consumer recomputes the prefill, which overwrites those
        slots). A keyed load checks the checksum first (a damaged entry is
        corrupt, removed as ever), then the tag (a forged entry's checksum is
        right).
        """
        start = time.perf_counter()
        with self._open_fitting(identity, token_ids, hidden_size, hidden_dtype) as (key, raw_tokens, path, f, header):
            fd, base = f.fileno(), header.data_start
            tag = header.tag_check(self.keys) if self.keys is not None else None
            digest = xxhash.xxh3_128()
            begin, end = header.span("token_ids")
            stored = os.pread(fd, end - begin, base + begin)
            if len(stored) != end - begin:
                raise fmt.EntryCorrupt(path, f"short read: {len(stored)} of {end - begin} token bytes")
            if stored != raw_tokens:
                expected = fmt.key_from_token_bytes(header.identity, stored)
                if path.name != f"{expected}{fmt.ENTRY_SUFFIX}":
                    raise fmt.EntryCorrupt(path, f"content hashes to key {expected}, not the file name")
                raise TokenMismatch(f"{path.name}: stored token ids differ from the prompt's")
            digest.update(stored)
            if tag is not None:
                tag.update(stored)
            kv_info = header.tensors["kv"]
            kv_begin, kv_end = header.span("kv")
            layers = identity.num_layers
            layer_bytes = (kv_end - kv_begin) // layers
            group = max(1, min(layers, LOAD_CHUNK_BYTES // max(1, layer_bytes)))  # layers per read
            staging = self._staging(group * layer_bytes)
            kv_dtype = TAG_TO_TORCH[kv_info["dtype"]]
            for first in range(0, layers, group):
                count = min(group, layers - first)
                chunk = staging[:count * layer_bytes]
                view = memoryview(chunk.numpy())
                _pread_exact(path, fd, view, base + kv_begin + first * layer_bytes)
                digest.update(view)
                if tag is not None:
                    tag.update(view)
                kv_chunk = chunk.view(kv_dtype).view([count, *kv_info["shape"][1:]])
                for i in range(count):
                    write_layer(first + i, kv_chunk[i])
            h_begin, h_end = header.span("hidden")
            hidden_raw = torch.empty(h_end - h_begin, dtype=torch.uint8)
            if h_end > h_begin:
                hview = memoryview(hidden_raw.numpy())
                _pread_exact(path, fd, hview, base + h_begin)
                digest.update(hview)
                if tag is not None:
                    tag.update(hview)
            if "xxh3_128:" + digest.hexdigest() != header.checksum:
                raise fmt.EntryCorrupt(path, "checksum mismatch: data does not match the checksum in the header")
            if tag is not None:  # a forged entry carries a right checksum: only the tag tells
                tag.finish()
            _touch(f)
        info = header.tensors["hidden"]
        hidden = hidden_raw.view(TAG_TO_TORCH[info["dtype"]]).view(info["shape"])
        return LoadedEntry(key, None, hidden, header.data_len, time.perf_counter() - start)

    @contextlib.contextmanager
    def _open_fitting(self, identity: fmt.KVIdentity, token_ids: Sequence[int], hidden_size: int | None,
                      hidden_dtype: torch.dtype | None) -> Iterator[tuple[str, bytes, Path, BinaryIO, fmt.EntryHeader]]:
        """The entry for these tokens, open, its header parsed and checked to fit (load and load_into's start).

        Yields (key, the tokens' bytes, path, file, header); raises what `load` documents.
        """
        raw_tokens = fmt.token_bytes(token_ids)
        key = fmt.key_from_token_bytes(identity, raw_tokens)
        path = fmt.entry_path(self.root, key)
        with fmt.open_entry(path) as (f, _):
            header = fmt.parse_header(path, f)
            _check_fits(header, identity, len(raw_tokens) // 8, hidden_size, hidden_dtype)
            yield key, raw_tokens, path, f, header

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` this thread reuses across loads (grown when too small)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, STAGING_MIN_BYTES), dtype=torch.uint8)
            self._local.staging = buf
        return buf[:nbytes]

    @staticmethod
    def _tensor(header: fmt.EntryHeader, data: torch.Tensor, name: str) -> torch.Tensor:
        info = header.tensors[name]
        begin, end = header.span(name)
        dtype = TAG_TO_TORCH[info["dtype"]]
        return data[begin:end].view(dtype).view(info["shape"])


def _check_fits(header: fmt.EntryHeader, identity: fmt.KVIdentity, num_tokens: int,
                hidden_size: int | None, hidden_dtype: torch.dtype | None) -> None:
    """The entry is exactly what this reader needs, else EntryCorrupt (checked from the header alone)."""
    path = header.path
    if header.identity != identity:
        raise fmt.EntryCorrupt(path, f"identity {header.identity} != expected {identity}")
    if header.num_tokens != num_tokens:
        raise fmt.EntryCorrupt(path, f"holds {header.num_tokens} tokens, the prompt has {num_tokens}")
    kv = header.tensors["kv"]
    want = [identity.num_layers, identity.kv_parts, num_tokens, identity.kv_heads, identity.head_size]
    if kv["dtype"] != identity.dtype or kv["shape"] != want:
        raise fmt.EntryCorrupt(path, f"kv is {kv['dtype']} {kv['shape']}, this reader needs "
                                     f"{identity.dtype} {want}")
    hidden = header.tensors["hidden"]
    tag = hidden["dtype"]
    if tag not in TAG_TO_TORCH:
        raise fmt.EntryCorrupt(path, f"hidden dtype {tag} has no torch dtype")
    if hidden_dtype is not None and TAG_TO_TORCH[tag] != hidden_dtype:
        raise fmt.EntryCorrupt(path, f"hidden is {tag}, this reader needs {dtype_tag(hidden_dtype)}")
    if hidden_size is not None and hidden["shape"][1] != hidden_size:
        raise fmt.EntryCorrupt(path, f"hidden has {hidden['shape'][1]} columns, this model's hidden size "
                                     f"is {hidden_size}")


def _pread_exact(path: Path, fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset`; a short read (the file was cut short) is EntryCorrupt."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise fmt.EntryCorrupt(path, f"short read at data offset {offset + got}")
        got += n


def _touch(f) -> None:
    """Make the entry open as `f` recent (its mtime is the LRU clock): that file, never a symlink's target."""
    try:
        os.utime(f.fileno())
    except OSError:
        pass  # a read-only store or another user's entry: recency is best effort
