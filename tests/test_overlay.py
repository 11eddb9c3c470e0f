"""The overlay: this kvctl's code for the rig side, keyed by content, many side by side.

Light tests (no torch): what goes in, the key, building once, coexisting and
pruned overlays, a python that gets our plugin entry point through it, and the
local runtime putting it first on a server's PYTHONPATH.
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

from kvctl.provision import overlay

ROOT = Path(__file__).resolve().parent.parent


def test_plan_takes_the_installed_packages_and_the_plugin_entry_point():
    plan = overlay.plan_overlay()
    assert plan.packages == {"connectors": str(ROOT / "connectors"), "kvctl": str(ROOT / "kvctl")}
    files = dict(plan.files)
    assert files["connectors/plugin.py"] == ROOT / "connectors" / "plugin.py"
    assert "kvctl/provision/overlay.py" in files
    assert not any("__pycache__" in rel or rel.endswith(".pyc") for rel in files)
    # The checkout links its data dirs into the package: not followed, not in the overlay.
    assert not any(rel.startswith(("kvctl/scenario/scenarios/", "kvctl/provision/dockerfiles/"))
                   for rel in files)
    info = dict(plan.dist_info)
    eps = next(text for rel, text in info.items() if rel.endswith("entry_points.txt"))
    assert eps == "[vllm.general_plugins]\nkvctl_connectors = connectors.plugin:register\n"
    assert len(plan.key) == overlay.KEY_LEN and overlay.plan_overlay().key == plan.key


def test_built_once_used_from_anywhere_and_keyed_by_content(tmp_path, monkeypatch):
    first = overlay.ensure_overlay(home=tmp_path)
    assert first.built and first.path == tmp_path / "overlays" / first.key
    again = overlay.ensure_overlay(home=tmp_path)
    assert not again.built and again.path == first.path
    site = first.site
    assert (site / "connectors" / "plugin.py").read_bytes() == (ROOT / "connectors" / "plugin.py").read_bytes()
    meta = json.loads((first.path / "overlay.json").read_text())
    assert meta["key"] == first.key and meta["packages"]["connectors"] == str(ROOT / "connectors")

    # Another python, elsewhere, with only the overlay on its path: our package and entry point.
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as md, connectors.plugin as p; "
         "print(p.__file__); print([e.value for e in md.entry_points(group='vllm.general_plugins') "
         "if e.name == 'kvctl_connectors'])"],
        cwd="/", env={**os.environ, "PYTHONPATH": overlay.pythonpath(first, None)},
        capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    origin, eps = probe.stdout.splitlines()
    assert origin == str(site / "connectors" / "plugin.py")
    assert eps == "['connectors.plugin:register']"  # the overlay's dist-info comes first

    # A second copy of the code with one change: a second overlay next to the first.
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "connectors", clone / "connectors",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "connectors" / "plugin.py").write_text(
        (ROOT / "connectors" / "plugin.py").read_text() + "\n# the clone's change\n")
    real = overlay._package_dir
    monkeypatch.setattr(overlay, "_package_dir",
                        lambda name: clone / name if name == "connectors" else real(name))
    second = overlay.ensure_overlay(home=tmp_path)
    assert second.built and second.key != first.key
    assert (second.site / "connectors" / "plugin.py").read_text().endswith("# the clone's change\n")
    assert (first.site / "connectors" / "plugin.py").read_bytes() == (ROOT / "connectors" / "plugin.py").read_bytes()
    assert overlay.overlay_status(home=tmp_path)["overlays"] == sorted([first.key, second.key])


def test_unused_overlays_and_dead_builds_are_pruned_by_the_next_build(tmp_path):
    root = tmp_path / "overlays"
    old, recent, dead = root / "a", root / "b", root / ".tmp-c-1"
    for d in (old, recent, dead):
        d.mkdir(parents=True)
    for d in (old, recent):
        (d / "overlay.json").write_text("{}")
        (d / "last-used").touch()
    long_ago = time.time() - overlay.MAX_AGE_S - 60
    os.utime(old / "last-used", (long_ago, long_ago))
    os.utime(dead, (long_ago, long_ago))
    built = overlay.ensure_overlay(home=tmp_path)
    assert built.built
    assert sorted(p.name for p in root.iterdir()) == sorted(["b", built.key])


def test_concurrent_builds_of_one_overlay_both_succeed(tmp_path):
    code = ("import sys; from pathlib import Path; from kvctl.provision import overlay; "
            "o = overlay.ensure_overlay(home=Path(sys.argv[1])); print(o.key, o.built)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    keys = {out.split()[0] for out, _ in outs}
    assert len(keys) == 1
    assert [p.name for p in (tmp_path / "overlays").iterdir()] == [keys.pop()]  # no temp dir left


def test_missing_metadata_is_a_clear_error(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(overlay.BadInput, match="this kvctl is not installed"):
        overlay.plan_overlay()


def test_local_runtime_puts_the_overlay_first_on_the_servers_path(tmp_path, monkeypatch):
    """The server command itself fails here (no vLLM); its log header and record say what it got."""
    from kvctl.runtime.base import InstanceSpec
    from kvctl.runtime.local import LocalRuntime

    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    runtime = LocalRuntime(python=Path(sys.executable))
    spec = InstanceSpec(cluster="c", role="prefill", model=tmp_path, served_model_name="m",
                        dtype="float32", port=1, cwd=tmp_path / "cwd", log_path=tmp_path / "p.log")
    inst = runtime.start(spec)
    deadline = time.monotonic() + 30
    while inst.status().running and time.monotonic() < deadline:
        time.sleep(0.1)
    inst.stop()
    header = spec.log_path.read_text().splitlines()[1]
    ov = runtime.overlay
    assert header == (f"kvctl: its connectors: overlay {ov.key} "
                      f"(PYTHONPATH={ov.site}{os.pathsep}/somewhere/else)")
    assert inst.record()["overlay"] == str(ov.path)
    assert ov.path.parent == tmp_path / "home" / "overlays"



def _readme_overlay_line() -> str:
    """The README's own-vLLM recipe line that puts the overlay on PYTHONPATH."""
    text = (ROOT / "README.md").read_text()
    recipe = text[text.index("## Using the connectors in your own vLLM"):]
    return next(line for line in recipe.splitlines() if line.startswith("export PYTHONPATH=")
                and "kvctl rig overlay" in line)


def test_rig_overlay_builds_on_a_fresh_home_and_the_readme_recipe_works(kvctl, kvctl_home, tmp_path):
    before = json.loads(kvctl("rig", "status", "--json").stdout)["overlay"]
    assert before["built"] is False and not Path(before["site"]).exists()  # a fresh $KVCTL_HOME

    r = kvctl("rig", "overlay")
    assert r.rc == 0, r
    site = Path(r.stdout.strip())
    assert r.stdout == f"{site}\n" and str(site) == before["site"]  # the site alone: for $(...)
    assert (site / "connectors" / "log_lines.py").is_file() and "built" in r.stderr
    after = json.loads(kvctl("rig", "status", "--json").stdout)["overlay"]
    assert after["built"] is True and after["key"] == before["key"]

    again = json.loads(kvctl("rig", "overlay", "--json").stdout)
    assert (again["site"], again["built"], again["built_now"]) == (str(site), True, False)
    assert again["engine"] is None and again["python"] is None

    # The README's line, as a user runs it in a shell on a fresh home: the connectors and the
    # plugin entry point come from the overlay.
    home = tmp_path / "fresh-home"
    env = {**os.environ, "KVCTL_HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    script = (_readme_overlay_line() + "\n" + f"{sys.executable} -c \"import importlib.metadata as md, "
              "connectors.plugin as p; print(p.__file__); print([e.value for e in "
              "md.entry_points(group='vllm.general_plugins') if e.name == 'kvctl_connectors'])\"")
    probe = subprocess.run(["bash", "-ec", script], cwd="/", env=env, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr
    origin, eps = probe.stdout.splitlines()
    assert origin.startswith(str(home / "overlays")) and origin.endswith("/site/connectors/plugin.py")
    assert eps == "['connectors.plugin:register']"


def test_rig_overlay_engine_names_the_rig_and_refuses_an_unknown_one(kvctl, kvctl_home):
    bad = kvctl("rig", "overlay", "--engine", "v9", "--json")
    assert bad.rc == 2 and "engine" in json.loads(bad.stdout)["error"]
    assert not (kvctl_home / "overlays").exists()  # refused before anything was built
    out = json.loads(kvctl("rig", "overlay", "--engine", "v0", "--json").stdout)
    assert out["engine"] == "v0" and Path(out["site"]).is_dir()
    override = kvctl.env.get("KVCTL_RIG_PYTHON")
    # the rig's interpreter: the test rig's override, or none (no rig under a fresh home)
    assert out["python"] == (str(Path(override).absolute()) if override else None)
