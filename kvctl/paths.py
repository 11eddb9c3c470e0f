"""Where kvctl keeps its state: $KVCTL_HOME (default ~/.cache/kvctl).

kvctl never looks for a source checkout: its data files (scenarios,
Dockerfiles) are package data, and the code the servers run comes from the
installed packages (kvctl.provision.overlay).
"""

from __future__ import annotations

import os
from pathlib import Path


def kvctl_home() -> Path:
    return Path(os.environ.get("KVCTL_HOME") or Path.home() / ".cache" / "kvctl").expanduser()
