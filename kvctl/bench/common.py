"""What every benchmark shares: timing, bench dirs, machine info, the rig subprocess.

No torch here: the rig-side modules import this too, and so does kvctl.
"""

from __future__ import annotations

import json
import math
import os
import platform
import secrets
import shutil
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from kvctl.errors import BadInput, RuntimeFailure
from kvctl.paths import kvctl_home
from kvctl.provision.overlay import ensure_overlay, pythonpath
from kvctl.provision.rig import rig_python
from kvctl.subprocesses import run_streamed

Progress = Callable[[str], None]
RIG_TIMEOUT_S = 3600.0  # one rig-side bench; 512 MB entries on a busy 2-core box take minutes


def quiet(_: str) -> None:
    """A Progress that drops everything."""


def best_of(fn: Callable[[], object], repeat: int, before: Callable[[], object] | None = None,
            after: Callable[[], object] | None = None) -> float:
    """Fastest of `repeat` timed calls of `fn`, in seconds.

    `before` and `after` run untimed around each call (e.g. drop the page
    cache, remove the file just written). The minimum is the figure least
    disturbed by the other tenants of a shared machine.
    """
    best = math.inf
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if after is not None:
            after()
    return best


def speed_ratio(baseline_s: float, ours_s: float) -> float:
    """Our throughput over the baseline's for the same bytes: > 1 means ours is faster."""
    return baseline_s / ours_s if ours_s > 0 else math.inf


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else math.inf


def parse_sizes(raw: list[str] | None, default: list[float], unit: str,
                integer: bool) -> list[float]:
    """Sizes from ["1,64", "512"] style input (comma-separated, repeatable), sorted, unique.

    Raises BadInput (field `sizes`) for a value that is not a positive number.
    """
    if not raw:
        return list(default)
    sizes: list[float] = []
    for item in ",".join(raw).split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item) if integer else float(item)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            kind = "whole number" if integer else "number"
            raise BadInput(f"size {item!r} is not a positive {kind} of {unit}", field="sizes",
                           fix=f"pass positive {unit}, comma-separated, e.g. "
                               f"{','.join(f'{d:g}' for d in default)}")
        sizes.append(value)
    return sorted(set(sizes))


def check_repeat(repeat: int) -> int:
    """`repeat`, checked. Raises BadInput (field `repeat`) below 1."""
    if repeat < 1:
        raise BadInput(f"repeat must be at least 1, got {repeat}", field="repeat",
                       fix="pass how many timed runs to take the best of, e.g. 3")
    return repeat


def resolve_bench_dir(path: Path | None) -> Path:
    """The directory benches write into: `path`, else $KVCTL_HOME/bench (created)."""
    root = (path.expanduser() if path is not None else kvctl_home() / "bench").resolve()
    if root.exists() and not root.is_dir():
        raise BadInput(f"{root} is not a directory", field="dir",
                       fix="pass a directory on the filesystem to measure")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create the bench directory {root}: {e.strerror}", field="dir",
                       fix="pass a writable directory") from None
    return root


@contextmanager
def scratch_dir(root: Path) -> Iterator[Path]:
    """A fresh directory under `root`, removed with everything in it afterwards."""
    path = root / f"run-{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- machine info: what a reader needs to judge the numbers ---

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest /proc/mounts prefix)."""
    target = str(path.resolve())
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info(bench_dir: Path | None = None) -> dict:
    """CPU, cores, memory, kernel, load, date, and the bench dir's filesystem."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "cpu_model": _cpu_model(),
        "cores": cores,
        "mem_total_bytes": _mem_total_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if bench_dir is not None:
        info["bench_dir"] = str(bench_dir)
        info["fs_type"] = fs_type(bench_dir)
    return info


# --- running a torch-side bench in the rig ---

def run_in_rig(module: str, params: dict, progress: Progress = quiet,
               timeout_s: float = RIG_TIMEOUT_S) -> dict:
    """Run `python -m kvctl.bench.<module> '<params>'` in the rig; its stdout JSON.

    The rig-side module comes from this kvctl's overlay (first on PYTHONPATH;
    the rig itself holds no kvctl), so every installation measures its own
    code. It runs in the overlay's directory, so no checkout in the caller's
    working directory shadows it. Each stderr line goes to `progress`.
    Raises BadInput when no rig is installed, RuntimeFailure when the bench
    fails or prints no JSON.
    """
    python = rig_python()
    overlay = ensure_overlay()
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath(overlay, env.get("PYTHONPATH"))
    argv = [str(python), "-m", f"kvctl.bench.{module}", json.dumps(params)]
    done = run_streamed(argv, progress, env=env, cwd=str(overlay.path), capture_stdout=True,
                        timeout_s=timeout_s)
    what = f"the {module} benchmark"
    if done.timed_out:
        raise RuntimeFailure(f"{what} ran longer than {timeout_s:.0f} s and was stopped",
                             where=f"{python} -m kvctl.bench.{module}",
                             fix="use smaller sizes or fewer repeats", details=done.details)
    if done.returncode != 0:
        raise RuntimeFailure(f"{what} failed in the rig (exit {done.returncode})",
                             where=f"{python} -m kvctl.bench.{module}",
                             fix="read the output below; `kvctl rig status` checks the rig",
                             details=done.details)
    text = done.stdout.strip()
    try:
        result = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        raise RuntimeFailure(f"{what} printed no JSON object", where=f"{python} -m kvctl.bench.{module}",
                             details=(text[-2000:] or done.details))
    return result


def rig_main(run: Callable[[dict, Progress], dict], argv: list[str]) -> int:
    """Entry point of a rig-side bench: params JSON in argv[1], result JSON on stdout."""
    import sys

    params = json.loads(argv[1]) if len(argv) > 1 else {}

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run(params, progress)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0
