"""kvctl installs like a Python tool (issue 12), for real: no mocks.

- A wheel built from this checkout, installed into a fresh venv and run from a
  directory that is no checkout: `kvctl rig install` finds the shared rig (no
  step runs: nothing of kvctl goes into it), scenarios come from package data,
  and a 1P1D cluster launches and verifies with the wheel's connectors
  (its overlay).
- While that cluster runs, a second checkout (a `git clone` at another path,
  with a marker added to its connectors) launches its own cluster from its
  own editable install: both verify, each server runs the connectors of the
  kvctl that launched it, and both go down cleanly.
- Afterwards the rig is unchanged (its site-packages listing), and this
  checkout's `kvctl rig python` and tests still work.

Both use a tmp KVCTL_HOME whose rigs/ is the real one (so the real rig is
used, not rebuilt). Needs the CPU rig and the tests' layered venv (conftest's
`rig_python`); builds the wheel and installs kvctl's dependencies with pip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvctl.paths import kvctl_home
from kvctl.provision import rig

ROOT = Path(__file__).resolve().parent.parent
REAL_HOME = kvctl_home()  # read at import, before a fixture points KVCTL_HOME elsewhere
MARKER = "KVCTL-SECOND-CHECKOUT-CONNECTORS"

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]


def run(argv: list, env: dict, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{argv}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def copy_checkout(dest: Path) -> Path:
    """This checkout's files as git sees them (tracked and new, not ignored), links kept."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, dst = ROOT / name, dest / name
        if not os.path.lexists(src):
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


def make_venv(path: Path) -> Path:
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-m", "venv", path], os.environ, path.parent, timeout=300)
    return path / "bin"


def site_listing(site: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_mtime_ns) for p in site.iterdir() if p.name != "__pycache__")


def cluster(home: Path, name: str) -> dict:
    return json.loads((home / "clusters" / name / "cluster.json").read_text())


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.timeout(3600)
def test_wheel_install_and_a_second_checkout_share_the_rig_and_run_side_by_side(
        tmp_path, rig_python, tiny_model, vllm_slot):
    real = rig.Rig(rig.default_spec(), home=REAL_HOME)
    assert not real.unfinished(), f"the rig at {real.dir} is not installed"
    rig_site = real.site_packages()
    before = site_listing(rig_site)
    home = tmp_path / "home"
    home.mkdir()
    (home / "rigs").symlink_to(REAL_HOME / "rigs")
    env = {k: v for k, v in os.environ.items()
           if k not in (rig.PYTHON_ENV, rig.SPEC_ENV, "PYTHONPATH", "VIRTUAL_ENV")}
    env["KVCTL_HOME"] = str(home)
    work = tmp_path / "elsewhere"  # no checkout here: nothing to find by accident
    work.mkdir()
    times: dict[str, float] = {}
    up: list[Path] = []

    # 1. A wheel, in a fresh venv.
    t0 = time.monotonic()
    bin1 = make_venv(tmp_path / "venv-wheel")
    src = copy_checkout(tmp_path / "src")
    run([bin1 / "python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src],
        env, work)
    (wheel,) = (tmp_path / "dist").glob("kvctl-*.whl")
    run([bin1 / "python", "-m", "pip", "install", "-q", wheel], env, work)
    times["wheel build + install"] = time.monotonic() - t0
    shutil.rmtree(src)  # the wheel's kvctl must not need its source
    kv1 = bin1 / "kvctl"
    installed = json.loads(run([kv1, "rig", "install", "--json"], env, work).stdout)
    assert {s["status"] for s in installed["steps"]} == {"already done"}
    assert installed["path"] == str(home / "rigs" / real.dir.name)
    st = json.loads(run([kv1, "rig", "status", "--json"], env, work).stdout)
    assert st["installed"] and not st["overlay"]["built"]
    assert st["overlay"]["packages"]["connectors"].startswith(str(tmp_path / "venv-wheel"))
    assert "smoke-1p1d" in run([kv1, "scenario", "list"], env, work).stdout  # package data
    try:
        t0 = time.monotonic()
        run([kv1, "launch", "1p1d", "--name", "wheel", "--model", tiny_model], env, work, timeout=900)
        up.append(kv1)
        times["launch (wheel)"] = time.monotonic() - t0
        run([kv1, "verify", "--name", "wheel"], env, work)

        # 2. A second checkout at another path, launched while the first runs.
        clone = tmp_path / "clone"
        run(["git", "clone", "-q", ROOT, clone], env, work)
        plugin = clone / "connectors" / "plugin.py"
        plugin.write_text(plugin.read_text() + f"\nimport sys as _s\nprint({MARKER!r}, __file__, "
                          "file=_s.stderr, flush=True)\n")
        bin2 = make_venv(tmp_path / "venv-clone")
        run([bin2 / "python", "-m", "pip", "install", "-q", "-e", clone], env, work)
        kv2 = bin2 / "kvctl"
        t0 = time.monotonic()
        run([kv2, "launch", "1p1d", "--name", "clone", "--model", tiny_model], env, clone, timeout=900)
        up.append(kv2)
        times["launch (clone, beside the wheel's)"] = time.monotonic() - t0
        run([kv2, "verify", "--name", "clone"], env, clone)
        run([kv1, "verify", "--name", "wheel"], env, work)  # the first still verifies

        # Each server runs the connectors of the kvctl that launched it.
        overlays = {}
        for name in ("wheel", "clone"):
            for role, inst in cluster(home, name)["instances"].items():
                ov = Path(inst["overlay"])
                assert ov.parent == home / "overlays"
                overlays.setdefault(name, set()).add(ov)
                assert environ_of(inst["pid"])["PYTHONPATH"].split(os.pathsep)[0] == str(ov / "site")
                log = Path(inst["log_path"]).read_text(errors="replace")
                seen = f"{MARKER} {ov / 'site' / 'connectors' / 'plugin.py'}" in log
                assert seen == (name == "clone"), (name, role)
        assert len(overlays["wheel"]) == len(overlays["clone"]) == 1
        assert overlays["wheel"] != overlays["clone"]
        meta = json.loads((overlays["clone"].pop() / "overlay.json").read_text())
        assert meta["packages"]["connectors"] == str(clone / "connectors")
    finally:
        for kv, name in zip(up, ("wheel", "clone")):
            subprocess.run([kv, "down", "--name", name], env=env, cwd=work, capture_output=True,
                           timeout=300)
    assert not (home / "clusters" / "wheel").exists() and not (home / "clusters" / "clone").exists()

    # 3. The rig is as it was; this checkout's rig python and tests still work.
    assert site_listing(rig_site) == before
    here = {k: v for k, v in os.environ.items() if k != rig.PYTHON_ENV}
    here["KVCTL_HOME"] = str(REAL_HOME)
    py = run([sys.executable, "-m", "kvctl.cli", "rig", "python"], here, ROOT).stdout.strip()
    assert py == str(real.python)
    assert run([kv1, "rig", "python"], env, work).stdout.strip() == str(home / "rigs" / real.dir.name / "venv" / "bin" / "python")
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                 "tests/test_overlay.py", "tests/test_tiny_model.py"], here, ROOT, timeout=900)
    assert " passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout[-2000:]
    print("timings:", json.dumps({k: round(v, 1) for k, v in times.items()}))
