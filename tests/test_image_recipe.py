"""The CPU image: a rig image keyed by the rig's inputs, and a thin layer with the overlay.

docker/Dockerfile.rig runs docker/rig-install.py with the base image's system
python, which has nothing but the standard library, on the recipe files
images.RECIPE_FILES puts under build/. These tests read the recipe's
import closure from the source and check both halves: that it needs only the
standard library, and that the build context carries every file of it. Then
the split: the rig image's tag moves with the pins, not with kvctl's code; the
CPU image's tag moves with the overlay (this kvctl's code), on the same rig.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = "/opt/kvctl/build/"  # where rig-install.py finds the kvctl package (--code)
RECIPE = "kvctl.provision.rig"


def _module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def recipe_files() -> set[str]:
    """Paths (relative to the checkout) of every kvctl or connectors file importing the recipe loads."""
    found: set[str] = set()
    todo = [RECIPE]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way, then the module
            path = _module_file(".".join(parts[:i]))
            if path is None:
                continue
            rel = str(path.relative_to(ROOT))
            if rel in found:
                continue
            found.add(rel)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                todo += [n for n in names if n.split(".")[0] in ("kvctl", "connectors") and _module_file(n)]
    return found


def test_the_rig_recipe_needs_only_the_standard_library(tmp_path):
    files = recipe_files()
    assert "kvctl/provision/rig.py" in files and "kvctl/errors.py" in files
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    # -S: no site-packages at all, as in the base image's bare python.
    out = subprocess.run([sys.executable, "-S", "-c",
                          f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                          f"import {RECIPE} as rig; print(rig.RigSpec().key())"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) == 12


def test_the_rig_image_context_carries_the_whole_recipe():
    from kvctl.provision import images

    plan = images.plan_rig()
    names = {name for name, _ in plan.files}
    missing = sorted(f for f in recipe_files() if f"build/{f}" not in names)
    assert missing == [], f"images.RECIPE_FILES must list these: {missing}"
    assert {"Dockerfile", "build/rig-spec.json", "build/rig-install.py", "build/ca.crt"} <= names
    assert not any(n.startswith(("src/", "overlay/")) for n in names)  # no project code
    text = (ROOT / "docker" / "Dockerfile.rig").read_text()
    assert "COPY build/ /opt/kvctl/build/" in text and f"--code {BUILD_DIR.rstrip('/')}" in text
    assert json.loads(dict(plan.files)["build/rig-spec.json"])["engine"] == "v0"


def test_rig_image_is_keyed_by_the_rig_inputs_not_kvctl_code(monkeypatch, tmp_path):
    from kvctl.provision import images

    tag = images.plan_rig().tag
    code = images.recipe_files()
    monkeypatch.setattr(images, "recipe_files", lambda: [(n, d + b"\n# edited\n") for n, d in code])
    assert images.plan_rig().tag == tag
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"requirements": ["numpy<2.3"]}))
    monkeypatch.setenv("KVCTL_RIG_SPEC", str(spec))
    assert images.plan_rig().tag != tag


def test_cpu_image_is_the_rig_image_plus_this_kvctls_overlay(monkeypatch):
    from kvctl.provision import images, overlay

    rig_plan = images.plan_rig()
    cpu = images.plan_cpu(rig_plan)
    assert cpu.build_args == {"RIG_IMAGE": rig_plan.tag} and cpu.base_image == rig_plan.tag
    files = dict(cpu.files)
    assert files["overlay/connectors/plugin.py"] == (ROOT / "connectors" / "plugin.py").read_bytes()
    eps = next(d for n, d in files.items() if n.endswith(".dist-info/entry_points.txt"))
    assert b"kvctl_connectors = connectors.plugin:register" in eps
    assert {n.split("/")[0] for n in files} == {"Dockerfile", "overlay"}
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert "COPY overlay/ /opt/kvctl/overlay/" in text and "ENV PYTHONPATH=/opt/kvctl/overlay" in text

    plan = overlay.plan_overlay()
    edited = dataclasses.replace(plan, key="0" * 16,
                                 dist_info=plan.dist_info + (("x.dist-info/EXTRA", "1"),))
    monkeypatch.setattr(images, "plan_overlay", lambda: edited)
    assert images.plan_rig().tag == rig_plan.tag  # same rig layer ...
    assert images.plan_cpu().tag != cpu.tag  # ... new thin layer


def test_v1_cpu_image_is_the_v1_rig_then_its_extras_then_the_overlay(monkeypatch, tmp_path):
    """Engine v1 on CPU: the V1 rig's pins in Dockerfile.rig (the V0 rig's key untouched), its extras
    in a layer of their own keyed by their pins, the overlay on top; the host's own wheel of the
    torch pin (not on the registry as a CPU build) goes into the rig's context, unkeyed."""
    from kvctl.provision import extras, images

    v0, v1 = images.plan_rig(), images.plan_rig("v1")
    assert v0.tag.startswith("kvctl-rig:") and v1.tag.startswith("kvctl-rig-v1:") and v0.tag[10:] != v1.tag[13:]
    # V1's sampler is compiled by torch inductor at the first request: its base has a compiler
    assert {"g++", "python3-dev"} <= set(images.ENGINE_BASE_PACKAGES["v1"])
    assert v1.base_image == images.base_tag("v1") != images.base_tag("v0") == v0.base_image
    assert json.loads(dict(v1.files)["build/rig-spec.json"])["engine"] == "v1"
    ext = images.plan_extras(v1, "v1")
    assert images.plan_extras(v0, "v0") is None
    assert ext.tag.startswith("kvctl-extras-v1:") and ext.base_image == v1.tag
    assert ext.build_args == {"RIG_IMAGE": v1.tag, "EXTRAS": "nixl lmcache", "ENGINE": "v1"}
    names = {n for n, _ in ext.files}
    assert {"Dockerfile", "build/extras-install.py", "build/kvctl/provision/extras.py"} <= names
    cpu = images.plan_cpu(engine="v1")
    assert cpu.tag.startswith("kvctl-cpu-v1:") and cpu.build_args == {"RIG_IMAGE": ext.tag}
    assert images.default_image("cpu", "v1") == cpu.tag
    text = (ROOT / "docker" / "Dockerfile.extras").read_text()
    assert f"kvctl.sites={images.IMAGE_SITES}" in text and "kvctl.engine=${ENGINE}" in text
    # a new pin of an extra: a new extras layer, the same rig
    pinned = dataclasses.replace(extras.LMCACHE, installs=(extras.PipInstall(("lmcache==9.9",), deps=False),))
    monkeypatch.setitem(extras.EXTRAS, "lmcache", pinned)
    assert images.plan_rig("v1").tag == v1.tag and images.plan_extras(v1, "v1").tag != ext.tag

    # local wheels: found in PIP_FIND_LINKS dirs, carried as host files, named in the image's spec
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
    (wheels / "torch-2.130.0-cp311-cp311-any.whl").write_bytes(b"another version")
    monkeypatch.setattr(images, "pip_find_links", lambda: [wheels])
    assert [w.name for w in images.local_wheels(("torch==2.13.0",))] == [
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    plan = images.plan_rig("v1")
    assert [n for n, _ in plan.host_files] == ["build/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert json.loads(dict(plan.files)["build/rig-spec.json"])["pip_args"][-2:] == ["--find-links",
                                                                                   images.IMAGE_WHEELS]
    import tarfile
    with tarfile.open(fileobj=plan.context()) as tar:
        assert tar.extractfile(plan.host_files[0][0]).read() == b"wheel"
    monkeypatch.setattr(images, "pip_find_links", lambda: [])
    assert images.plan_rig("v1").host_files == () and images.plan_rig("v1").tag != plan.tag


def test_pip_find_links_reads_the_environment_and_pips_config(monkeypatch, tmp_path):
    from kvctl.provision import images

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = file://{b} https://example.invalid/wheels\n")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{a} {tmp_path / 'missing'}")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    found = images.pip_find_links()
    assert a in found and b in found and tmp_path / "missing" not in found


def test_dockerfiles_are_package_data_linked_to_the_top_level_docker_dir():
    from kvctl.provision import images

    assert images.DOCKERFILES.resolve() == (ROOT / "docker").resolve()
    for name in ("Dockerfile.rig", "Dockerfile.cpu", "Dockerfile.gpu", "rig-install.py",
                 "patch-vllm-lmcache.py", "Dockerfile.extras", "extras-install.py"):
        assert (images.DOCKERFILES / name).is_file(), name
