"""kvctl must run where neither torch nor vLLM is installed (a laptop driving GPU hosts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"

PROBE = """
import importlib.util, sys
assert importlib.util.find_spec("torch") is None, "this venv is supposed to be torch-free"
import kvctl.cli, kvctl.verify.verifier, kvctl.cluster.lifecycle, kvctl.store.inspect, kvctl.scenario.schema
import kvctl.provision.overlay, kvctl.provision.images, kvctl.runtime.local
import connectors.store.format, connectors.config.validate
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm", "transformers"))
assert not heavy, heavy
print("light ok")
"""


def test_kvctl_imports_without_torch_or_vllm():
    if not VENV_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV_PYTHON} missing: `make venv` creates the light venv")
        pytest.skip("no light .venv (run `make venv`)")
    out = subprocess.run([str(VENV_PYTHON), "-c", PROBE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    help_out = subprocess.run([str(VENV_PYTHON), "-m", "kvctl.cli", "--help"],
                              capture_output=True, text=True)
    assert help_out.returncode == 0 and "inspect-store" in help_out.stdout, help_out.stderr
