"""`python -m kvctl.router`: run the P/D router as its own process.

    python -m kvctl.router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]
        --port N [--host 127.0.0.1] [--api-key KEY] [--kv-transfer-params]
        [--policy round_robin|least_outstanding]
        [--health-interval S] [--prefill-timeout S] [--decode-idle-timeout S] [--log-level L]

Each URL may be named: `--prefill p-a=http://127.0.0.1:8100`. The API key may also come
from $KVCTL_ROUTER_API_KEY (so it stays out of `ps`). Logs go to stderr; the first
line after start-up is `... kvctl-router listening on http://HOST:PORT ...`. Exit
codes: 0 after SIGINT/SIGTERM, 2 for bad arguments, 3 when the address cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from kvctl.errors import ExitCode, KvctlError
from kvctl.router import config as cfg
from kvctl.router.app import serve

MODULE = "kvctl.router"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description="kvctl's P/D router: one OpenAI-compatible endpoint "
                                            "in front of prefill and decode vLLM servers.")
    p.add_argument("--prefill", action="append", default=[], metavar="[NAME=]URL", required=True,
                   help="a prefill server (repeat for several); unnamed ones are prefill-0, prefill-1, ...")
    p.add_argument("--decode", action="append", default=[], metavar="[NAME=]URL", required=True,
                   help="a decode server (repeat for several); unnamed ones are decode-0, decode-1, ...")
    p.add_argument("--host", default=cfg.DEFAULT_HOST, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get(cfg.API_KEY_ENV) or None,
                   help=f"require `Authorization: Bearer KEY` on /v1/* (default ${cfg.API_KEY_ENV})")
    p.add_argument("--kv-transfer-params", action="store_true",
                   help="the handshake of connectors like NIXL: P is asked for kv_transfer_params "
                        "(do_remote_decode), D gets the ones P answered with; a P answer without "
                        "them is a 502")
    p.add_argument("--policy", default=cfg.DEFAULT_POLICY, choices=cfg.POLICIES,
                   help="how each pool picks an instance (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=cfg.HEALTH_INTERVAL_S, metavar="S",
                   help="seconds between /health checks of each instance (default %(default)s)")
    p.add_argument("--health-timeout", type=float, default=cfg.HEALTH_TIMEOUT_S, metavar="S",
                   help="seconds one /health check may take (default %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=cfg.CONNECT_TIMEOUT_S, metavar="S",
                   help="seconds to connect to an instance (default %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=cfg.PREFILL_TIMEOUT_S, metavar="S",
                   help="seconds a prefill request may take (default %(default)s)")
    p.add_argument("--decode-idle-timeout", type=float, default=cfg.DECODE_IDLE_TIMEOUT_S, metavar="S",
                   help="longest silence from a decode instance mid-answer (default %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    try:
        config = cfg.build_config(
            args.prefill, args.decode, host=args.host, port=args.port, api_key=args.api_key,
            kv_transfer_params=args.kv_transfer_params, policy=args.policy,
            health_interval_s=args.health_interval, health_timeout_s=args.health_timeout, connect_timeout_s=args.connect_timeout,
            prefill_timeout_s=args.prefill_timeout, decode_idle_timeout_s=args.decode_idle_timeout)
    except KvctlError as e:
        e.locate(lambda field: "--" + field.replace("_", "-"))
        print(f"error: {e.message}", file=sys.stderr)
        return int(e.exit_code)
    try:
        asyncio.run(serve(config))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return int(ExitCode.RUNTIME_FAILED)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
