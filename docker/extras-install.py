"""Install an engine's extras inside an image build (Dockerfile.extras).

Calls kvctl.provision.extras directly (standard library only, as rig-install.py
calls the rig's recipe), one extra at a time, each verified by its own script,
then links each extra's site-packages at $KVCTL_HOME/sites/<name> so the image
has stable paths for the docker runtime (images.IMAGE_SITES).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON file of the rig's RigSpec fields")
    parser.add_argument("--code", required=True, help="dir holding the kvctl package to use")
    parser.add_argument("extras", nargs="+", help="extra names (kvctl.provision.extras.EXTRAS)")
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    from kvctl.errors import KvctlError
    from kvctl.provision import extras, rig

    spec = rig.load_spec(args.spec)
    sites = Path(os.environ["KVCTL_HOME"]) / "sites"
    sites.mkdir(parents=True, exist_ok=True)

    def show(ev: rig.StepEvent) -> None:
        if ev.state in ("start", "done", "skipped", "failed"):
            extra = f" ({ev.seconds:.0f} s)" if ev.state == "done" else ""
            print(f"extra [{ev.index}/{ev.total}] {ev.step}: {ev.state}{extra} {ev.note}".rstrip(), flush=True)

    for name in args.extras:
        try:
            info = extras.install_extra(extras.get_extra(name), spec, progress=show)
        except KvctlError as e:
            print(e.message, file=sys.stderr)
            if e.details:
                print(e.details, file=sys.stderr)
            return 1
        link = sites / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(info.site)
        print(f"extra {name} ready: {link} -> {info.site} ({info.total_s:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
