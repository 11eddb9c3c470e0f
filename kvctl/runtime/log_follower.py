"""The docker runtime's log follower: a container's output, appended to a host file.

`spawn_follower` starts `python -m kvctl.runtime.log_follower follow --engine
URL --container ID --log PATH` detached (its own session) right after the
container starts. It copies `docker logs --follow` into the instance's log
file, so log tails, markers, `kvctl logs` and verify read files exactly as
with the local runtime, and the file keeps growing after `kvctl launch`
exits. It appends one closing line with the exit code and ends when the
container stops (or is removed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvctl.runtime.docker_engine import connect

MODULE = "kvctl.runtime.log_follower"  # what `python -m` runs


def follow_container(engine: str, container_id: str, log_path: Path) -> int:
    """Append the container's output to `log_path` until it stops. Returns 0."""
    import docker.errors

    client = connect(engine, timeout=None)  # an idle server can be silent for hours
    try:
        container = client.containers.get(container_id)
        with open(log_path, "ab", buffering=0) as f:
            for chunk in container.logs(stream=True, follow=True):
                f.write(chunk)
            container.reload()
            code = container.attrs["State"].get("ExitCode")
            f.write(f"kvctl: container {container.name} stopped (exit code {code})\n".encode())
    except docker.errors.NotFound:
        pass  # removed: nothing more to copy
    return 0


def spawn_follower(engine: str, container_id: str, log_path: Path) -> subprocess.Popen:
    """Start the follower for a container, detached; its own failures land in the log too."""
    argv = [sys.executable, "-m", MODULE, "follow", "--engine", engine,
            "--container", container_id, "--log", str(log_path)]
    with open(log_path, "ab") as errors:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=errors, start_new_session=True, close_fds=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    follow = sub.add_parser("follow", help="append a container's output to a file until it stops")
    follow.add_argument("--engine", required=True)
    follow.add_argument("--container", required=True)
    follow.add_argument("--log", required=True, type=Path)
    args = parser.parse_args(argv)
    return follow_container(args.engine, args.container, args.log)


if __name__ == "__main__":
    sys.exit(main())
