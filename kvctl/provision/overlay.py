"""The overlay: this kvctl installation's own code, brought to a read-only rig.

A rig holds torch and vLLM only. What vLLM servers (and the rig-side benches)
need of this project reaches them through an overlay directory put first on
their PYTHONPATH, built from the distribution of the kvctl that is running,
however it was installed (editable checkout, wheel, sdist, pipx): the
`connectors` and `kvctl` packages are found with importlib, the entry points
are read from its installed metadata.

    $KVCTL_HOME/overlays/<key>/
        site/                          what goes on PYTHONPATH
            connectors/                the connectors package of this kvctl
            kvctl/                     kvctl itself (the rig-side benches import it)
            kvctl-<version>.dist-info/ METADATA, entry_points.txt: the
                                       `vllm.general_plugins` entry point
                                       (kvctl_connectors = connectors.plugin:register)
        overlay.json                   where it came from: packages, distribution, files
        last-used                      touched whenever a launch uses it

`key` is a hash of every file's path and content (and the dist-info), so the
same code gives the same overlay from any checkout, and two checkouts with
different code get two overlays side by side: each cluster runs the
connectors of the kvctl that launched it. An overlay is built in a temp dir
and renamed into place (there whole or not at all; a concurrent build of the
same key finds it done) and never changed afterwards. Overlays not used for
MAX_AGE_S are removed when a new one is built.

Standard library only (like rig.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

# ---- defaults ----------------------------------------------------------------------
DISTRIBUTION = "kvctl"  # the distribution whose entry points the overlay carries
PACKAGES = ("connectors", "kvctl")  # top-level packages copied into site/
ENTRY_POINT_GROUPS = ("vllm.general_plugins",)  # the groups vLLM reads
SKIP_DIRS = ("__pycache__",)
SKIP_SUFFIXES = (".pyc", ".pyo")
MAX_AGE_S = 14 * 24 * 3600  # an overlay unused this long is removed by the next build
TMP_MAX_AGE_S = 3600  # a half-built temp dir this old belongs to a build that died
KEY_LEN = 16  # hex digits of the content hash in the directory name
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlayPlan:
    """What an overlay of this kvctl holds; computed from the installed files, writes nothing."""

    key: str
    files: tuple[tuple[str, Path], ...]  # (path under site/, source file)
    dist_info: tuple[tuple[str, str], ...]  # (path under site/, text)
    packages: dict[str, str]  # package -> the directory it was copied from
    distribution: str  # the directory its distribution metadata was found in
    version: str

    def file_count(self) -> int:
        return len(self.files) + len(self.dist_info)


@dataclass(frozen=True)
class Overlay:
    """A built overlay: `site` goes first on the servers' PYTHONPATH."""

    key: str
    path: Path
    site: Path
    built: bool  # True: this call built it; False: it was there
    seconds: float


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if len(locations) != 1:
        raise BadInput(f"cannot locate the {name!r} package of this kvctl "
                       f"(found {locations or 'nothing'})", where="sys.path",
                       fix="reinstall kvctl (pip install kvctl, or pip install -e . in a checkout)")
    return Path(locations[0])


def _package_files(name: str, root: Path) -> list[tuple[str, Path]]:
    """Files of the package at `root`, as (path under site/, file); caches left out.

    Symlinked directories are not followed (a checkout links its data dirs in).
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for fname in sorted(filenames):
            if fname.startswith(".") or fname.endswith(SKIP_SUFFIXES):
                continue
            path = Path(dirpath) / fname
            if path.is_file():
                found.append((f"{name}/{path.relative_to(root).as_posix()}", path))
    return found


def _dist_info() -> tuple[tuple[tuple[str, str], ...], str, str]:
    """The overlay's dist-info files, where the metadata was found, and the version.

    Raises BadInput when this kvctl has no installed metadata (run from a bare
    source tree), or its metadata declares no vLLM plugin entry point.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BadInput(f"this kvctl is not installed: no {DISTRIBUTION} distribution metadata "
                       "(its vLLM plugin entry point lives there)", where="sys.path",
                       fix="install it: pip install -e . in a checkout, or pip install kvctl") from None
    entry_points = sorted({(ep.group, ep.name, ep.value) for ep in dist.entry_points
                           if ep.group in ENTRY_POINT_GROUPS})
    if not entry_points:
        raise BadInput(f"the installed {DISTRIBUTION} metadata declares no "
                       f"{' or '.join(ENTRY_POINT_GROUPS)} entry point",
                       where=_location(dist),
                       fix="reinstall kvctl from a complete source or wheel")
    version = dist.version
    lines, group = [], None
    for ep_group, name, value in entry_points:
        if ep_group != group:
            lines.append(f"{'' if group is None else chr(10)}[{ep_group}]")
            group = ep_group
        lines.append(f"{name} = {value}")
    info = f"{DISTRIBUTION}-{version}.dist-info"
    files = ((f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {version}\n"
              "Summary: kvctl overlay: this kvctl's connectors and vLLM plugin entry point\n"),
             (f"{info}/entry_points.txt", "\n".join(lines) + "\n"),
             (f"{info}/INSTALLER", "kvctl-overlay\n"),
             (f"{info}/RECORD", ""))
    return files, _location(dist), version


def _location(dist: importlib.metadata.Distribution) -> str:
    """The directory holding the distribution's metadata (site-packages, or a checkout's root)."""
    return str(Path(str(dist.locate_file(""))).absolute())


def plan_overlay() -> OverlayPlan:
    """The overlay of the running kvctl: its files and content key (a few hundred small
    files are read and hashed). Raises BadInput when kvctl's packages or metadata are missing."""
    files: list[tuple[str, Path]] = []
    packages = {}
    for name in PACKAGES:
        root = _package_dir(name)
        packages[name] = str(root)
        files += _package_files(name, root)
    dist_info, where, version = _dist_info()
    h = hashlib.sha256()
    for rel, path in files:
        h.update(f"{rel}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    for rel, text in dist_info:
        h.update(f"{rel}\0{hashlib.sha256(text.encode()).hexdigest()}\n".encode())
    return OverlayPlan(h.hexdigest()[:KEY_LEN], tuple(files), dist_info, packages, where, version)


def overlays_dir(home: Path | None = None) -> Path:
    return (home or kvctl_home()) / "overlays"


def ensure_overlay(plan: OverlayPlan | None = None, home: Path | None = None) -> Overlay:
    """The overlay for `plan` (default: this kvctl's), built if missing; marks it used.

    Raises OSError when $KVCTL_HOME is not writable.
    """
    t0 = time.monotonic()
    plan = plan or plan_overlay()
    root = overlays_dir(home)
    target = root / plan.key
    built = False
    if not (target / "overlay.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        _prune(root)
        tmp = root / f".tmp-{plan.key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write(plan, tmp)
            try:
                tmp.rename(target)
                built = True
            except OSError:
                if not (target / "overlay.json").is_file():
                    raise  # not a concurrent build of the same overlay: a real error
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    (target / "last-used").touch()
    return Overlay(plan.key, target, target / "site", built, time.monotonic() - t0)


def _write(plan: OverlayPlan, tmp: Path) -> None:
    site = tmp / "site"
    for rel, src in plan.files:
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    for rel, text in plan.dist_info:
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    # Written last: a directory with overlay.json is complete.
    (tmp / "overlay.json").write_text(json.dumps({
        "key": plan.key, "version": plan.version, "packages": plan.packages,
        "distribution": plan.distribution, "files": plan.file_count(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=1) + "\n")


def _prune(root: Path) -> None:
    """Remove overlays unused for MAX_AGE_S and temp dirs of builds that died."""
    now = time.time()
    for entry in root.iterdir():
        try:
            if entry.name.startswith(".tmp-"):
                if now - entry.stat().st_mtime > TMP_MAX_AGE_S:
                    shutil.rmtree(entry, ignore_errors=True)
            elif now - (entry / "last-used").stat().st_mtime > MAX_AGE_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # a concurrent prune, or no last-used yet: leave it


def pythonpath(overlay: Overlay, existing: str | None, extras: tuple[Path, ...] | list[Path] = ()) -> str:
    """PYTHONPATH with the overlay first, then the site-packages of the server's extras
    (kvctl.provision.extras), then whatever was there."""
    return os.pathsep.join(p for p in (str(overlay.site), *map(str, extras), existing) if p)


def overlay_status(home: Path | None = None) -> dict:
    """The overlay this kvctl would use: its key and path, whether it is built, its sources."""
    plan = plan_overlay()
    path = overlays_dir(home) / plan.key
    return {"key": plan.key, "path": str(path), "site": str(path / "site"),
            "built": (path / "overlay.json").is_file(), "version": plan.version,
            "files": plan.file_count(), "packages": plan.packages,
            "distribution": plan.distribution,
            "entry_points": [line for rel, text in plan.dist_info
                             if rel.endswith("entry_points.txt") for line in text.splitlines()
                             if "=" in line],
            "overlays": sorted(p.name for p in overlays_dir(home).glob("*")
                               if (p / "overlay.json").is_file())}
