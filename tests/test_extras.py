"""Extras (kvctl.provision.extras): venvs layered on a rig for a connector's packages.

The mechanism runs on a tiny offline rig of engine v1 with probe wheels (no
download): install, the second install at once, the rig untouched, a failed
verify named and retried, status, which servers get which site-packages. The
real NIXL extra is checked on the real V1 rig (skipped without it, failed under
KVCTL_REQUIRE_RIG_V1=1): a UCX READ between two agents with UCX_TLS=tcp,cma,
and the same check failing with a transport that does not work here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvctl.errors import BadInput, RuntimeFailure
from kvctl.provision import extras, rig
from test_rig import PROBE, kvctl, tiny_rig_env, write_wheel

REQUIRE_RIG_V1 = os.environ.get("KVCTL_REQUIRE_RIG_V1") == "1"

PROBE_VERIFY = r"""
import json, os
r = {"ok": False, "problem": ""}
try:
    import kvctl_extra_probe, kvctl_rig_probe
    r["probe"] = kvctl_extra_probe.VERSION
    r["from_rig"] = kvctl_rig_probe.VERSION
    r["ok"] = os.environ.get("PROBE_MODE") == "good"
    if not r["ok"]:
        r["problem"] = "PROBE_MODE is " + repr(os.environ.get("PROBE_MODE"))
except Exception as e:
    r["problem"] = repr(e)
print("KVCTL_VERIFY " + json.dumps(r))
"""


def probe_extra(mode: str = "good") -> extras.Extra:
    return extras.Extra(
        name="probe", engine="v1", summary="a probe", connectors=("ProbeConnector",),
        installs=(extras.PipInstall(("kvctl_extra_probe==1.0",)),
                  extras.PipInstall(("kvctl_extra_nodeps==1.0",), deps=False)),
        verify=PROBE_VERIFY, verify_env=(("PROBE_MODE", mode),))


@pytest.fixture(scope="module")
def tiny_v1_env(tmp_path_factory):
    """A tiny offline rig of engine v1 in a tmp KVCTL_HOME (one per module: the tests'
    extras differ in their inputs, so each gets its own directory); its environment."""
    tmp_path = tmp_path_factory.mktemp("tiny-v1")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels)  # the rig's package
    write_wheel(wheels, "kvctl_extra_probe")
    write_wheel(wheels, "kvctl_extra_nodeps")
    env = tiny_rig_env(tmp_path, wheels, engine="v1")
    env.pop("KVCTL_RIG_V1_PYTHON", None)
    built = kvctl("rig", "install", "--engine", "v1", env=env)
    assert built.returncode == 0, built.stderr
    return env


@pytest.fixture
def tiny_v1(tiny_v1_env, monkeypatch):
    """tiny_v1_env, also in this process's environment (the library calls read it)."""
    for key in ("KVCTL_HOME", rig.SPEC_ENV):
        monkeypatch.setenv(key, tiny_v1_env[key])
    monkeypatch.delenv("KVCTL_RIG_V1_PYTHON", raising=False)
    return tiny_v1_env


def rig_site(env: dict) -> Path:
    return next((Path(env["KVCTL_HOME"]) / "rigs").glob("probe-*/venv/lib/python*/site-packages"))


def test_extra_installs_beside_the_rig_once_and_servers_naming_its_connector_get_it(tiny_v1):
    before = sorted(p.name for p in rig_site(tiny_v1).iterdir())
    extra = probe_extra()
    first = extras.install_extra(extra)
    assert [s.status for s in first.steps] == ["ran", "ran", "ran"]
    verify = first.steps[-1].note
    assert "probe 1.0" in verify and "from_rig 1.0" in verify and "PROBE_MODE=good" in verify
    assert (first.site / "kvctl_extra_probe.py").is_file()
    assert (first.site / "kvctl_extra_nodeps.py").is_file()
    assert first.path.parent == Path(tiny_v1["KVCTL_HOME"]) / "extras"
    assert sorted(p.name for p in rig_site(tiny_v1).iterdir()) == before  # the rig is untouched

    second = extras.install_extra(extra)
    assert [s.status for s in second.steps] == ["already done"] * 3
    assert second.total_s < 1.0 and second.path == first.path

    # Its inputs key it: another pin is another directory.
    other = extras.Extra(**{**extra.__dict__, "installs": extra.installs[:1]})
    assert extras.ExtraVenv(other, rig.default_spec("v1")).dir != first.path

    st = extras.extra_status(extra)
    assert st["installed"] and st["site"] == str(first.site) and st["size_bytes"] > 0
    assert st["pins"] == "kvctl_extra_probe==1.0; kvctl_extra_nodeps==1.0 (--no-deps)"
    assert st["install"] == "kvctl rig install --engine v1 --extra probe"

    # Which servers get it: a config naming its connector, itself or as a child.
    registry = {"probe": extra}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extras, "EXTRAS", registry)
        plain = {"kv_connector": "ProbeConnector", "kv_role": "kv_producer"}
        multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"connectors": [
                     {"kv_connector": "FSConnector", "kv_role": "kv_both"}, plain]}}
        assert extras.server_sites(plain, "v1") == [first.site]
        assert extras.server_sites(multi, "v1") == [first.site]
        assert extras.server_sites({"kv_connector": "FSConnector", "kv_role": "kv_both"}, "v1") == []
        assert extras.server_sites(None, "v1") == []
        with pytest.raises(BadInput, match="runs on engine v1, not v0"):
            extras.server_sites(plain, "v0")
        # The server's python sees both the extra and the rig with the site on PYTHONPATH.
        py = rig.rig_python(rig.default_spec("v1"))
        seen = subprocess.run([str(py), "-c", f"import kvctl_extra_probe, {PROBE}; print('ok')"],
                              env={**os.environ, "PYTHONPATH": str(first.site)},
                              capture_output=True, text=True)
        assert seen.stdout.strip() == "ok", seen.stderr


def test_missing_extra_names_the_command_and_a_failed_verify_runs_again(tiny_v1):
    bad = probe_extra("bad")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extras, "EXTRAS", {"probe": bad})
        with pytest.raises(BadInput) as missing:
            extras.server_sites({"kv_connector": "ProbeConnector", "kv_role": "kv_both"}, "v1")
        assert "needs the extra 'probe'" in missing.value.what
        assert "kvctl rig install --engine v1 --extra probe" in missing.value.fix
    with pytest.raises(RuntimeFailure) as failed:
        extras.install_extra(bad)
    assert "extra 'probe' install failed at step 'verify'" in failed.value.what
    assert "PROBE_MODE is 'bad'" in failed.value.what
    assert "kvctl rig install --engine v1 --extra probe" in failed.value.fix
    st = extras.extra_status(bad)
    assert not st["installed"]
    assert {s["name"]: s["state"] for s in st["steps"]} == {
        "venv": "done", "install": "done", "verify": "missing"}


def test_cli_status_shows_the_engines_extras_and_install_checks_the_names(tiny_v1):
    status = kvctl("rig", "status", "--engine", "v1", "--json", env=tiny_v1)
    assert status.returncode == 0, status.stderr
    shown = {e["name"]: e for e in json.loads(status.stdout)["extras"]}
    assert set(shown) == {e.name for e in extras.extras_for_engine("v1")} and "nixl" in shown
    assert not shown["nixl"]["installed"]
    assert shown["nixl"]["pins"] == "nixl-cu12==1.5.1; nixl==1.5.1 (--no-deps)"
    assert shown["nixl"]["verify_env"] == {"UCX_TLS": "tcp,cma"}
    human = kvctl("rig", "status", "--engine", "v1", env=tiny_v1)
    assert "extra nixl: not installed" in human.stdout
    assert "kvctl rig install --engine v1 --extra nixl" in human.stdout
    v0 = kvctl("rig", "status", "--json", env=tiny_v1)
    assert json.loads(v0.stdout)["extras"] == []
    wrong = kvctl("rig", "install", "--extra", "nixl", env=tiny_v1)
    assert wrong.returncode == 2 and "engine v1" in wrong.stderr and "Traceback" not in wrong.stderr
    unknown = kvctl("rig", "install", "--engine", "v1", "--extra", "nixxl", env=tiny_v1)
    assert unknown.returncode == 2 and "--extra" in unknown.stderr and "nixl" in unknown.stderr


# ---- the real NIXL extra on the real V1 rig ------------------------------------------------

def real_v1_rig() -> rig.RigSpec:
    spec = rig.engine_spec("v1")
    if not rig.rig_status(spec)["installed"]:
        if REQUIRE_RIG_V1:
            pytest.fail("the V1 rig is not installed (KVCTL_REQUIRE_RIG_V1=1)")
        pytest.skip("the V1 rig is not installed: `kvctl rig install --engine v1`")
    return spec


def test_nixl_extra_moves_bytes_over_ucx_here_and_the_check_fails_without_a_working_transport():
    spec = real_v1_rig()
    env = {k: v for k, v in os.environ.items() if k not in (rig.SPEC_ENV, "KVCTL_RIG_V1_PYTHON")}
    rig_dir = rig.Rig(spec).site_packages()
    done = kvctl("rig", "install", "--engine", "v1", "--extra", "nixl", "--json", env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)["extras"][0]
    assert info["name"] == "nixl"
    assert not list(rig_dir.glob("nixl*")), "NIXL went into the read-only rig"
    status = json.loads(kvctl("rig", "status", "--engine", "v1", "--json", env=env).stdout)
    nixl = next(e for e in status["extras"] if e["name"] == "nixl")
    assert nixl["installed"] and nixl["size_bytes"] > 100e6
    verified = next(s["note"] for s in nixl["steps"] if s["name"] == "verify")
    assert "backend UCX" in verified and "bytes 262144" in verified and "UCX_TLS=tcp,cma" in verified
    # The same check with shared memory alone: UCX cannot create its backend here.
    venv = extras.ExtraVenv(extras.NIXL, spec)
    failed = subprocess.run([str(venv.python), "-I", "-c", extras.NIXL.verify],
                            env={**env, "UCX_TLS": "sm"}, capture_output=True, text=True, timeout=120)
    line = next(x for x in failed.stdout.splitlines() if x.startswith("KVCTL_VERIFY "))
    result = json.loads(line[len("KVCTL_VERIFY "):])
    assert not result["ok"] and "NIXL_ERR_BACKEND" in result["problem"]
