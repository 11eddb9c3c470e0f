"""`kvctl router serve`: kvctl's P/D router in the foreground (`python -m kvctl.router` runs this).

What `kvctl launch` starts in front of a cluster's servers (kvctl.cluster.router_process),
and what a Kubernetes pod runs (kvctl render k8s). Logs go to stderr; the first line after
start-up is `... kvctl-router listening on http://HOST:PORT ...`. Exit codes: 0 after
SIGINT/SIGTERM, 2 for bad arguments, 3 when the address cannot be bound.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from enum import Enum

import typer

from kvctl.errors import RuntimeFailure
from kvctl.router import config as cfg

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

router_app = typer.Typer(help="kvctl's P/D router: one OpenAI-compatible endpoint in front of prefill "
                              "and decode vLLM servers.", no_args_is_help=True)

Policy = Enum("Policy", {p: p for p in cfg.POLICIES}, type=str)  # type: ignore[misc]


class LogLevel(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def register(app: typer.Typer) -> None:
    app.add_typer(router_app, name="router")


@router_app.command("serve")
def serve_cmd(
    prefill: list[str] = typer.Option(..., "--prefill", metavar="[NAME=]URL",
                                      help="A prefill server (repeat for several); unnamed ones are "
                                           "prefill-0, prefill-1, ..."),
    decode: list[str] = typer.Option(..., "--decode", metavar="[NAME=]URL",
                                     help="A decode server (repeat for several); unnamed ones are "
                                          "decode-0, decode-1, ..."),
    host: str = typer.Option(cfg.DEFAULT_HOST, "--host", help="Address to listen on."),
    port: int = typer.Option(..., "--port", help="Port to listen on (0: any free one)."),
    api_key: str | None = typer.Option(None, "--api-key", metavar="KEY", envvar=cfg.API_KEY_ENV,
                                       show_default=False,
                                       help=f"Require `Authorization: Bearer KEY` on /v1/* (default "
                                            f"${cfg.API_KEY_ENV}, which keeps it out of `ps`)."),
    kv_transfer_params: bool = typer.Option(
        False, "--kv-transfer-params",
        help="The handshake of connectors like NIXL: P is asked for kv_transfer_params (do_remote_decode), "
             "D gets the ones P answered with; a P answer without them is a 502."),
    policy: Policy = typer.Option(cfg.DEFAULT_POLICY, "--policy", help="How each pool picks an instance."),
    health_interval: float = typer.Option(cfg.HEALTH_INTERVAL_S, "--health-interval", metavar="S",
                                          help="Seconds between /health checks of each instance."),
    health_timeout: float = typer.Option(cfg.HEALTH_TIMEOUT_S, "--health-timeout", metavar="S",
                                         help="Seconds one /health check may take."),
    health_grace: float = typer.Option(cfg.HEALTH_GRACE_S, "--health-grace", metavar="S",
                                       help="A timed-out /health check marks an instance unhealthy only once "
                                            "its last 200 is this old (0: at once); a refusal or another "
                                            "status counts at once."),
    connect_timeout: float = typer.Option(cfg.CONNECT_TIMEOUT_S, "--connect-timeout", metavar="S",
                                          help="Seconds to connect to an instance."),
    prefill_timeout: float = typer.Option(cfg.PREFILL_TIMEOUT_S, "--prefill-timeout", metavar="S",
                                          help="Seconds a prefill request may take."),
    decode_idle_timeout: float = typer.Option(cfg.DECODE_IDLE_TIMEOUT_S, "--decode-idle-timeout", metavar="S",
                                              help="Longest silence from a decode instance mid-answer."),
    log_level: LogLevel = typer.Option(LogLevel.INFO, "--log-level", help="Log level (stderr)."),
) -> None:
    """Serve until SIGINT or SIGTERM. Each URL may be named: `--prefill p-a=http://127.0.0.1:8100`."""
    from kvctl.router.app import serve  # aiohttp: only for the command that runs it

    logging.basicConfig(level=log_level.value, format=LOG_FORMAT, stream=sys.stderr)
    config = cfg.build_config(
        prefill, decode, host=host, port=port, api_key=api_key or None, kv_transfer_params=kv_transfer_params,
        policy=policy.value,
        health_interval_s=health_interval, health_timeout_s=health_timeout, health_grace_s=health_grace,
        connect_timeout_s=connect_timeout,
        prefill_timeout_s=prefill_timeout, decode_idle_timeout_s=decode_idle_timeout)
    try:
        asyncio.run(serve(config))
    except OSError as e:
        raise RuntimeFailure(f"cannot listen on {host}:{port}: {e}", field="port",
                             fix="choose a free port (0: any), or an address of this host") from None
