"""The CPU image runs the rig recipe in a bare python: what it copies must be enough.

docker/Dockerfile.cpu copies a few files of this project (before the rest, so
the heavy rig layer is rebuilt only when the recipe changes) and runs
docker/rig-install.py with the base image's system python, which has nothing
but the standard library. These tests read the recipe's import closure from
the source and check both halves: that it needs only the standard library,
and that the Dockerfile copies every file of it to the right place.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"
BUILD_DIR = "/opt/kvctl/build/"  # where rig-install.py finds the kvctl package (--code)
RECIPE = "kvctl.provision.rig"


def _module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def recipe_files() -> set[str]:
    """Paths (relative to the checkout) of every kvctl file importing the recipe loads."""
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
                todo += [n for n in names if n.split(".")[0] == "kvctl" and _module_file(n)]
    return found


def dockerfile_recipe_copies() -> set[str]:
    """The kvctl files the COPY lines before the first rig-install run put under BUILD_DIR."""
    copied: set[str] = set()
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words[:1] == ["RUN"] and "rig-install.py" in line:
            break
        if words[:1] != ["COPY"] or not words[-1].startswith(BUILD_DIR + "kvctl"):
            continue
        dest = words[-1][len(BUILD_DIR):].rstrip("/")
        for src in words[1:-1]:
            assert src.startswith("src/"), line
            copied.add(f"{dest}/{Path(src).name}")
            assert src[len("src/"):] == f"{dest}/{Path(src).name}", f"{src} lands at {dest}: {line}"
    return copied


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


def test_dockerfile_cpu_copies_the_whole_recipe():
    missing = sorted(recipe_files() - dockerfile_recipe_copies())
    assert missing == [], f"docker/Dockerfile.cpu must COPY these before rig-install.py runs: {missing}"
