"""Where kvctl keeps its state: $KVCTL_HOME (default ~/.cache/kvctl)."""

from __future__ import annotations

import os
from pathlib import Path


def kvctl_home() -> Path:
    return Path(os.environ.get("KVCTL_HOME") or Path.home() / ".cache" / "kvctl").expanduser()


def project_root() -> Path:
    """The source checkout kvctl runs from (the rig installs it from here)."""
    return Path(__file__).resolve().parent.parent
