"""A passthrough FUSE filesystem (mfusepy over libfuse 3): BACKING_DIR served at MOUNTPOINT.

The hung-store test runs it as its own process and stops it (SIGSTOP): every
call on the mount then blocks in the kernel until SIGCONT, the way a stalled
network filesystem does. Usage: python passthrough_fuse.py BACKING_DIR MOUNTPOINT
(foreground; unmount with `fusermount3 -u MOUNTPOINT`).
"""

from __future__ import annotations

import errno
import os
import sys

import mfusepy as fuse


class Passthrough(fuse.Operations):
    """Every call goes to the same path under `root` (no caching of our own)."""

    use_ns = True

    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._full(path))
        keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._full(path))]

    def access(self, path, amode):
        if not os.access(self._full(path), amode):
            raise fuse.FuseOSError(errno.EACCES)

    def open(self, path, flags):
        return os.open(self._full(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        os.truncate(self._full(path) if fh is None else fh, length)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def release(self, path, fh):
        os.close(fh)

    def rename(self, old, new):
        os.rename(self._full(old), self._full(new))

    def unlink(self, path):
        os.unlink(self._full(path))

    def mkdir(self, path, mode):
        os.mkdir(self._full(path), mode)

    def rmdir(self, path):
        os.rmdir(self._full(path))

    def chmod(self, path, mode):
        os.chmod(self._full(path), mode)

    def utimens(self, path, times=None):
        os.utime(self._full(path), ns=times)

    def statfs(self, path):
        st = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
                "f_flag", "f_frsize", "f_namemax")
        return {k: getattr(st, k) for k in keys}


def main(argv: list[str]) -> int:
    backing, mountpoint = argv
    # Single-threaded and in the foreground: one process to stop and continue.
    fuse.FUSE(Passthrough(backing), mountpoint, foreground=True, nothreads=True, allow_other=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
