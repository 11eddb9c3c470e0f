"""Model identity for store keys: which weights and architecture a KV cache was computed with.

The `model` field of a KV identity (connectors.store.format.KVIdentity) must
change whenever the weights change, even at the same path, and be equal for
the same weights on two hosts that each hold their own copy at any path. This
module finds that identity for a model directory (or a single-file model such
as GGUF), without torch or vLLM, so kvctl may import it.

Where it comes from, first rule that applies (`weights_identity`):

1. A Hugging Face cache snapshot, ``.../models--ORG--NAME/snapshots/<commit>/``
   whose selected files (below) are all symlinks into that repository's
   ``blobs/`` (as the hub client writes them; blob names are content hashes):
   ``hf:ORG/NAME@<commit>``. Nothing is read; the commit names the content.
   A snapshot holding a regular file (someone replaced one by hand) is
   fingerprinted instead.
2. A model name that is not a local path (``ORG/NAME``, as vLLM accepts) and
   whose revision the Hugging Face cache holds (``refs/<revision>``, default
   ``main``, or a commit hash): rule 1 on that snapshot.
3. Any other local directory or file: a content fingerprint,
   ``files:xxh3_128:<32 hex>``.

The fingerprint covers the files that decide the weights and the
architecture, at the top level of the directory (vLLM loads nothing from
subdirectories): weights (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
``*.gguf``), their index files (``*.index.json``), ``config.json``,
``params.json`` (Mistral format), the quantization configs
(``quantize_config.json``, ``quant_config.json``, ``hf_quant_config.json``)
and remote code (``*.py``). Tokenizer files are left out on purpose: keys
hash token ids, so the tokenizer cannot change the KV of given ids. It is
xxh3-128 over, for each selected file in name order, its name relative to the
directory, its size and the xxh3-128 of its full content (streamed). A
single-file model is hashed the same way with an empty name, so its copies
match under any file name.

Hashing is bound by the disk: measured here (8.6 GB in 4 shards, 2 vCPUs,
virtual disk) 447 MB/s cold (19 s; so ~70 s for 30 GB), 1.35 GB/s when the
host still caches the data, 10 GB/s from the page cache (xxh3 itself runs at
13 GB/s). So each file's digest is cached (a warm start costs under 1 ms),
keyed by ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``, in one
small JSON file per model directory under
``$KVCTL_FINGERPRINT_CACHE`` (default ``$XDG_CACHE_HOME/kvctl/fingerprints``,
i.e. ``~/.cache/kvctl/fingerprints``). A regenerated, copied-over or
rewritten file has another inode, size, mtime or ctime (the ctime cannot be
set back by tools), so it is always hashed again. A file modified within
RACY_SECONDS of being hashed is not cached (a same-size rewrite within one
timestamp tick could otherwise keep its old stat). The cache file is
replaced atomically (concurrent writers: last one wins, nothing is ever
half-written); processes hashing the same directory take turns under an
``flock`` so the second one finds the first one's digests. An unwritable or
damaged cache only costs time: the digests are computed and used anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import logging
import os
import re
import stat as stat_mod
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import xxhash

from connectors.store.atomic import write_atomic

logger = logging.getLogger(__name__)

# What the fingerprint covers (top-level names; see the module docstring).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
CONFIG_PATTERNS = ("config.json", "params.json", "*.index.json", "quantize_config.json",
                   "quant_config.json", "hf_quant_config.json", "*.py")
SELECTED_PATTERNS = WEIGHT_PATTERNS + CONFIG_PATTERNS

FINGERPRINT_PREFIX = "files:xxh3_128:"
HF_PREFIX = "hf:"
CACHE_ENV = "KVCTL_FINGERPRINT_CACHE"
CACHE_VERSION = 1
READ_CHUNK = 8 << 20  # bytes per read while hashing
RACY_SECONDS = 2.0  # a file modified this recently is hashed but not cached
_DOMAIN = b"kvctl-model-fingerprint-v1\0"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HEX128 = re.compile(r"[0-9a-f]{32}")


class ModelIdentityError(Exception):
    """The model cannot be identified (missing, unreadable, nothing to fingerprint)."""

    def __init__(self, message: str, fix: str):
        self.message = message
        self.fix = fix
        super().__init__(f"{message} ({fix})")


@dataclass(frozen=True)
class WeightsIdentity:
    """The identity of a model's weights and how it was found (for the start-up log line)."""

    id: str  # "hf:ORG/NAME@<commit>" or "files:xxh3_128:<hex>"
    source: str  # "hf-snapshot", "hf-cache" or "fingerprint"
    path: str  # the directory or file it describes
    files: int = 0  # files fingerprinted
    bytes: int = 0  # their total size
    hashed_files: int = 0  # of those, read and hashed now (not from the cache)
    hashed_bytes: int = 0
    seconds: float = 0.0
    cache: str | None = None  # the cache file used, if any
    cache_problem: str | None = None  # why the cache could not be read or written

    def describe(self) -> str:
        if self.source != "fingerprint":
            return f"{self.id} ({self.source} {self.path})"
        text = (f"{self.id} ({self.files} files, {self.bytes / 1e9:.2f} GB in {self.path}; "
                f"{self.hashed_files} hashed ({self.hashed_bytes / 1e9:.2f} GB), "
                f"{self.files - self.hashed_files} cached, {self.seconds:.1f} s")
        if self.cache_problem:
            text += f"; cache not used: {self.cache_problem}"
        return text + ")"


def weights_identity(model: str | os.PathLike, *, revision: str | None = None,
                     cache_dir: str | os.PathLike | None = None) -> WeightsIdentity:
    """The identity of the model vLLM serves as `model` (a path, or a hub name with `revision`).

    `cache_dir` overrides where fingerprints are cached (default: the
    CACHE_ENV variable, else the user cache directory). Raises
    ModelIdentityError when the model is neither a local path nor a revision
    in the Hugging Face cache, when a directory holds no file to fingerprint,
    or when a file cannot be read.
    """
    path = Path(model).expanduser()
    if path.exists():
        snapshot = hf_snapshot_identity(path)
        if snapshot is not None:
            return WeightsIdentity(snapshot, "hf-snapshot", str(path))
        return fingerprint(path, cache_dir=cache_dir)
    cached = hf_cache_snapshot(str(model), revision)
    if cached is not None:
        snapshot = hf_snapshot_identity(cached)
        if snapshot is not None:
            return WeightsIdentity(snapshot, "hf-cache", str(cached))
        return fingerprint(cached, cache_dir=cache_dir)
    raise ModelIdentityError(
        f"cannot identify model {str(model)!r}: no such local path, and no revision "
        f"{revision or 'main'!r} of it in the Hugging Face cache {hf_hub_cache()}",
        "serve a local model directory, or set model_id to name the model's weights")


# -------------------------------------------------------------- Hugging Face

def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, as huggingface_hub resolves it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hf_snapshot_identity(path: str | os.PathLike) -> str | None:
    """``hf:ORG/NAME@<commit>`` when `path` is an untouched hub cache snapshot, else None."""
    real = Path(os.path.realpath(path))
    if not real.is_dir() or not _COMMIT.fullmatch(real.name) or real.parent.name != "snapshots":
        return None
    repo_dir = real.parent.parent
    if not repo_dir.name.startswith("models--"):
        return None
    repo = repo_dir.name[len("models--"):].replace("--", "/")
    blobs = os.path.realpath(repo_dir / "blobs")
    names = _selected_names(real)
    if not any(fnmatch.fnmatch(n, p) for n in names for p in WEIGHT_PATTERNS):
        return None
    for name in names:
        item = real / name
        if not item.is_symlink() or os.path.dirname(os.path.realpath(item)) != blobs:
            return None  # a file put there by hand: the commit no longer names the content
    return f"{HF_PREFIX}{repo}@{real.name}"


def hf_cache_snapshot(name: str, revision: str | None) -> Path | None:
    """The hub cache snapshot of repo `name` at `revision` (branch, tag or commit), or None."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    repo_dir = hf_hub_cache() / ("models--" + name.replace("/", "--"))
    revision = revision or "main"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        try:
            commit = (repo_dir / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


# -------------------------------------------------------------- fingerprint

@dataclass
class _Cache:
    """One model directory's cached file digests (a JSON file) and the lock around hashing."""

    path: Path
    problem: str | None = None
    entries: dict[str, dict] = field(default_factory=dict)

    def load(self) -> None:
        """Read the cache file (missing: empty; unreadable or damaged: empty, problem noted)."""
        try:
            raw = json.loads(self.path.read_bytes())
            if raw.get("version") == CACHE_VERSION and isinstance(raw.get("files"), dict):
                self.entries = {k: v for k, v in raw["files"].items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as e:
            self.problem = f"cannot read {self.path}: {e}"

    def get(self, name: str, st: os.stat_result) -> bytes | None:
        entry = self.entries.get(name)
        if entry is None or entry.get("stat") != _stat_key(st):
            return None
        digest = entry.get("xxh3_128")
        return bytes.fromhex(digest) if isinstance(digest, str) and _HEX128.fullmatch(digest) else None

    def save(self, target: Path, digests: dict[str, tuple[os.stat_result, bytes]]) -> None:
        """Replace the cache file with exactly these digests (atomic; failures are only noted)."""
        doc = {"version": CACHE_VERSION, "path": os.fsdecode(target),
               "files": {n: {"stat": _stat_key(st), "xxh3_128": d.hex()}
                         for n, (st, d) in sorted(digests.items())}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(self.path, json.dumps(doc, separators=(",", ":")), mode=0o600)
        except OSError as e:
            self.problem = f"cannot write {self.path}: {e.strerror or e}"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's hashing lock (so one process hashes, the next reads the cache)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.problem = f"cannot lock {self.path.with_suffix('.lock')}: {e.strerror or e}"
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "kvctl" / "fingerprints"


def fingerprint(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> WeightsIdentity:
    """The content fingerprint of a model directory or single-file model (see the module docstring).

    Raises ModelIdentityError when there is nothing to fingerprint or a file
    cannot be read, or changes while it is read.
    """
    start = time.perf_counter()
    target = Path(os.path.realpath(path))
    if target.is_dir():
        names = _selected_names(target)
        if not names:
            raise ModelIdentityError(
                f"model directory {target} holds none of the files that identify a model "
                f"({', '.join(SELECTED_PATTERNS)})",
                "serve a directory with the model's config and weights, or set model_id")
        files = {name: target / name for name in names}
    elif target.is_file():
        files = {"": target}
    else:
        raise ModelIdentityError(f"model path {target} is neither a directory nor a regular file",
                                 "serve a model directory or file, or set model_id")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache = _Cache(cache_dir / (xxhash.xxh3_64_hexdigest(os.fsencode(target)) + ".json"))
    hashed_files = hashed_bytes = 0
    digests: dict[str, tuple[os.stat_result, bytes]] = {}
    with cache.locked():
        cache.load()  # after the lock: what a process hashing before us cached
        cacheable = {}
        for name, file in files.items():
            st = _stat(file)
            digest = cache.get(name, st)
            if digest is None:
                st, digest = _hash_file(file)
                hashed_files += 1
                hashed_bytes += st.st_size
            digests[name] = (st, digest)
            if time.time() - st.st_mtime >= RACY_SECONDS:
                cacheable[name] = (st, digest)
        if hashed_files or set(cacheable) != set(cache.entries):
            cache.save(target, cacheable)
    h = xxhash.xxh3_128()
    h.update(_DOMAIN)
    total = 0
    for name in sorted(digests, key=os.fsencode):
        st, digest = digests[name]
        total += st.st_size
        h.update(os.fsencode(name) + b"\0" + st.st_size.to_bytes(8, "little") + digest)
    if cache.problem:
        logger.warning("model fingerprint cache not used: %s", cache.problem)
    return WeightsIdentity(FINGERPRINT_PREFIX + h.hexdigest(), "fingerprint", str(target),
                           files=len(digests), bytes=total, hashed_files=hashed_files,
                           hashed_bytes=hashed_bytes, seconds=time.perf_counter() - start,
                           cache=str(cache.path), cache_problem=cache.problem)


def _selected_names(directory: Path) -> list[str]:
    """Top-level names in `directory` that the fingerprint covers (regular files, symlinks followed)."""
    names = []
    with os.scandir(directory) as it:
        for item in it:
            if any(fnmatch.fnmatchcase(item.name, p) for p in SELECTED_PATTERNS):
                try:
                    if item.is_file():  # follows symlinks (hub snapshots are symlinks to blobs)
                        names.append(item.name)
                except OSError:
                    continue
    return sorted(names, key=os.fsencode)


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stat(file: Path) -> os.stat_result:
    try:
        return os.stat(file)
    except OSError as e:
        raise ModelIdentityError(f"cannot read model file {file}: {e.strerror or e}",
                                 "make the model's files readable by the server, or set model_id") from e


def _hash_file(file: Path) -> tuple[os.stat_result, bytes]:
    """(stat, xxh3-128 digest) of a whole file, read in chunks; the stat is taken on the open file."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ModelIdentityError(f"cannot read model file {file}: {e.strerror or e}",
                                 "make the model's files readable by the server, or set model_id") from e
    try:
        before = os.fstat(fd)
        if not stat_mod.S_ISREG(before.st_mode):
            raise ModelIdentityError(f"model file {file} is not a regular file",
                                     "replace it with the real file, or set model_id")
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h = xxhash.xxh3_128()
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        size = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
        after = os.fstat(fd)
    except OSError as e:
        raise ModelIdentityError(f"cannot read model file {file}: {e.strerror or e}",
                                 "make the model's files readable by the server, or set model_id") from e
    finally:
        os.close(fd)
    if _stat_key(before) != _stat_key(after) or size != after.st_size:
        raise ModelIdentityError(f"model file {file} changed while it was being hashed",
                                 "start the server once the model is completely written")
    return after, h.digest()


# -------------------------------------------------------------- served model

def served_model_key(weights: str, serving: Mapping[str, object]) -> str:
    """The `model` string of a KV identity: the weights' identity and the serving settings that change KV.

    `serving` holds settings such as the model dtype (which is also the
    hidden states' dtype), quantization, RoPE and config overrides; empty
    values (None, "", {}, False) are left out, so a setting at its default
    does not change the key. Values are written as compact JSON with sorted
    keys (strings as they are), settings in name order:
    ``hf:org/x@<commit>;dtype=bfloat16;quantization=fp8``.
    """
    parts = [weights]
    for name in sorted(serving):
        value = serving[name]
        if value is None or value is False or value == "" or value == {} or value == []:
            continue
        text = value if isinstance(value, str) else json.dumps(
            value, sort_keys=True, separators=(",", ":"), default=str)
        parts.append(f"{name}={text}")
    return ";".join(parts)
