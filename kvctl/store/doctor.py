"""`kvctl doctor store PATH`: does this path give the FS store what it needs?

Each check does the real operation in PATH, on files named like the store's
own temp files (so a store reader ignores them), and removes them:

    o_excl          O_CREAT | O_EXCL refuses an existing name (unique temp files)
    fsync           fsync on a written file succeeds (durable publish)
    atomic_rename   rename over an existing name replaces it, and a reader that
                    held the old file open still reads the old content whole
    free_space      at least `min_free` bytes are free (statvfs)
    permissions     the directory's mode, group and setgid bit, and whether
                    entries written here will be readable by the group
    mount_caching   on a network filesystem: whether the mount caches negative
                    lookups (a new entry stays invisible to D after a miss)

The store uses no extended attributes, so none are checked.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat as stat_mod
from dataclasses import dataclass, field
from pathlib import Path

from connectors.store.format import KEY_HEX_LEN, TEMP_SUFFIX
from kvctl.errors import BadInput

MIN_FREE_BYTES = 1 << 30  # below this, a store of real entries fills in minutes
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "fuse.sshfs", "ceph", "glusterfs", "lustre", "9p")


@dataclass
class DoctorCheck:
    name: str
    passed: bool
    detail: str
    warning: bool = False  # passed, but worth knowing (a network mount's caching)

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "warning": self.warning, "detail": self.detail}


@dataclass
class DoctorReport:
    path: Path
    filesystem: str
    mount_options: str
    checks: list[DoctorCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {"path": str(self.path), "filesystem": self.filesystem, "mount_options": self.mount_options,
                "checks": [c.to_json() for c in self.checks], "passed": self.passed}


def mount_of(path: Path, mounts_text: str | None = None) -> tuple[str, str, str]:
    """(filesystem type, mount options, mount point) of the mount holding `path` (/proc/mounts),
    or ("?", "", "")."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return "?", "", ""
    real, best = str(path.resolve()), ("", "?", "")
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, parts[2], parts[3])
    return best[1], best[2], best[0]


def fuse_daemon_options(mount_point: str, proc: Path = Path("/proc")) -> str | None:
    """The `-o` options of the sshfs process serving `mount_point` (its own options, such as
    negative_timeout, are not in /proc/mounts), or None when no such process is visible here."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if argv and argv[0].endswith("sshfs") and mount_point in argv:
            return ",".join(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-o")
    return None


def _temp_name(root: Path) -> Path:
    """A name of the store's temp-file form (`.<key>.<pid>.<rand>.tmp`): readers ignore it."""
    return root / f".{secrets.token_hex(KEY_HEX_LEN // 2)}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def doctor_store(path: Path | str, min_free: int = MIN_FREE_BYTES, mounts_text: str | None = None) -> DoctorReport:
    """Check `path` for what the store needs. Raises BadInput when it is not a writable directory."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise BadInput(f"{root} is not a directory", where=str(root),
                       fix="give the store directory (the fs_storage_path P and D share)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise BadInput(f"{root} is not writable by this user", where=str(root),
                       fix="run as the user the servers run as, or fix the directory's permissions")
    fs_type, options, point = mount_of(root, mounts_text)
    if fs_type == "fuse.sshfs":
        daemon = fuse_daemon_options(point)
        options = options if daemon is None else f"{options},{daemon}" if daemon else options
    report = DoctorReport(root, fs_type, options)
    made: list[Path] = []
    try:
        report.checks += [_o_excl(root, made), _fsync(root, made), _atomic_rename(root, made),
                          _free_space(root, min_free), _permissions(root), _mount_caching(fs_type, options)]
    finally:
        for p in made:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
    return report


def _create(root: Path, made: list[Path], data: bytes) -> Path:
    p = _temp_name(root)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    made.append(p)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return p


def _o_excl(root: Path, made: list[Path]) -> DoctorCheck:
    p = _create(root, made, b"a")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(fd)
    except FileExistsError:
        return DoctorCheck("o_excl", True, "O_CREAT | O_EXCL refuses an existing name")
    return DoctorCheck("o_excl", False, "O_CREAT | O_EXCL opened an existing name: two writers could share "
                                        "a temp file (NFSv2 and some FUSE filesystems ignore O_EXCL)")


def _fsync(root: Path, made: list[Path]) -> DoctorCheck:
    p = _create(root, made, b"x" * 4096)
    fd = os.open(p, os.O_WRONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        return DoctorCheck("fsync", False, f"fsync failed: {e.strerror or e} (set the FSConnector's "
                                           f"\"fsync\": false only if losing the newest entries on a crash is fine)")
    finally:
        os.close(fd)
    return DoctorCheck("fsync", True, "fsync of a written file succeeds")


def _atomic_rename(root: Path, made: list[Path]) -> DoctorCheck:
    old, new = _create(root, made, b"old" * 1000), _create(root, made, b"new" * 1000)
    with open(old, "rb") as held:
        try:
            os.replace(new, old)
        except OSError as e:
            return DoctorCheck("atomic_rename", False, f"rename over an existing name failed: {e.strerror or e}")
        made.remove(new)
        still = held.read()
    now = old.read_bytes()
    if now != b"new" * 1000:
        return DoctorCheck("atomic_rename", False, "after rename over an existing name, it does not hold the new file")
    if still != b"old" * 1000:
        return DoctorCheck("atomic_rename", False, "a reader holding the replaced file open did not read it whole: "
                                                   "D could read a mix of two entries")
    return DoctorCheck("atomic_rename", True, "rename replaces an existing name; a reader holding the old file "
                                              "reads it whole")


def _free_space(root: Path, min_free: int) -> DoctorCheck:
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    ok = free >= min_free
    return DoctorCheck("free_space", ok, f"{free / 2**30:.1f} GiB free" + ("" if ok else
                       f", under {min_free / 2**30:.1f} GiB: bound the store (FSConnector max_bytes) or free space"))


def _permissions(root: Path) -> DoctorCheck:
    st = os.stat(root)
    mode = stat_mod.S_IMODE(st.st_mode)
    setgid = bool(st.st_mode & stat_mod.S_ISGID)
    umask = os.umask(0)
    os.umask(umask)
    group_reads = bool(mode & 0o040) and not umask & 0o040
    detail = (f"directory mode {mode:04o}, group {st.st_gid}{', setgid' if setgid else ''}; this process's "
              f"umask {umask:03o}: entries it writes are {'' if group_reads else 'not '}readable by the group")
    if not setgid and mode & 0o070:
        detail += " (without setgid, entries get the writer's group, not the directory's)"
    return DoctorCheck("permissions", True, detail)


def _mount_caching(fs_type: str, options: str) -> DoctorCheck:
    if fs_type not in NETWORK_FS:
        return DoctorCheck("mount_caching", True, f"{fs_type}: a local filesystem, no lookup cache in the way")
    opts = dict((o.split("=", 1) + [""])[:2] for o in options.split(","))
    if fs_type.startswith("nfs"):
        cached = opts.get("lookupcache", "all") == "all" and "noac" not in opts
        fix = "mount with lookupcache=positive (or noac / actimeo=0)"
    elif fs_type == "fuse.sshfs":  # the kernel's options do not show sshfs's own; FUSE's negative cache
        cached = float(opts.get("negative_timeout", "0") or 0) > 0
        fix = "mount with negative_timeout=0"
    else:
        return DoctorCheck("mount_caching", True, f"{fs_type}: a network filesystem; check that it caches no "
                                                  f"negative lookups (docs/store-format.md, \"Network filesystems\")",
                           warning=True)
    if cached:
        return DoctorCheck("mount_caching", True, f"{fs_type} caches negative lookups: after a miss, D may not see "
                                                  f"a new entry for seconds and recomputes; {fix}", warning=True)
    return DoctorCheck("mount_caching", True, f"{fs_type}: no negative lookup cache")
