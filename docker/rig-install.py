"""Run `kvctl rig install`'s recipe inside an image build (Dockerfile.rig).

The system python of the base image has none of kvctl's CLI dependencies, so
this calls kvctl.provision.rig directly (it needs only the standard library). It prints
one line per rig step, and links $KVCTL_HOME/venv to the rig's venv so the
image has a stable interpreter path (/opt/kvctl/venv/bin/python).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON file of RigSpec fields")
    parser.add_argument("--code", required=True, help="dir holding the kvctl package to use")
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    from kvctl.provision import rig
    from kvctl.errors import KvctlError

    spec = rig.load_spec(args.spec)

    def show(ev: rig.StepEvent) -> None:
        if ev.state in ("start", "done", "skipped", "failed"):
            extra = f" ({ev.seconds:.0f} s)" if ev.state == "done" else ""
            print(f"rig [{ev.index}/{ev.total}] {ev.step}: {ev.state}{extra} {ev.note}".rstrip(),
                  flush=True)

    try:
        info = rig.install(progress=show, spec=spec)
    except KvctlError as e:
        print(e.message, file=sys.stderr)
        if e.details:
            print(e.details, file=sys.stderr)
        return 1
    link = Path(os.environ["KVCTL_HOME"]) / "venv"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(info.python.parent.parent)
    print(f"rig ready: {link} -> {info.python.parent.parent} ({info.total_s:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
