"""`python -m kvctl.router ARGS`: the router as its own process, the same as `kvctl router serve ARGS`.

    python -m kvctl.router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]
        --port N [--host 127.0.0.1] [--api-key KEY] [--kv-transfer-params]
        [--policy round_robin|least_outstanding] [--health-interval S] [--health-grace S] [--prefill-timeout S] [--decode-idle-timeout S] [--log-level L]

The command itself (its options, exit codes, the LISTENING line) is kvctl.commands.router;
this entry point stays for what starts the router this way: `kvctl launch`
(kvctl.cluster.router_process) and the router's Kubernetes pod (kvctl render k8s). It loads
that one command, not the whole CLI: a launch waits for the router to start.
"""

from __future__ import annotations

import sys

from kvctl.commands.router import serve_cmd
from kvctl.frontend import run, single_command_app

PROG = "python -m kvctl.router"


def main(argv: list[str] | None = None) -> int:
    return run(single_command_app(serve_cmd), list(sys.argv[1:] if argv is None else argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
