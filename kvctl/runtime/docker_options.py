"""The docker-only part of a cluster spec, validated: image, GPUs, bind address, engines.

A plain value type: a ClusterSpec holds one without depending on the docker
runtime (or the docker SDK). Errors name the field at fault (`image`, `gpus`,
`bind`, `prefill_docker_host`, `decode_docker_host`); each front end spells it
its own way.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvctl.errors import BadInput
from kvctl.runtime.base import ROLES
from kvctl.runtime.docker_engine import engine_hostname, engine_url, is_loopback

DEFAULT_BIND = "127.0.0.1"
DEFAULT_GPUS = ("0", "1")  # prefill, decode: used on a GPU image when no gpus are given

_GPU_RE = re.compile(r"^\d+(\+\d+)*$")


@dataclass(frozen=True)
class DockerOptions:
    """The docker-only parts of a cluster spec."""

    image: str | None = None  # None: the cpu image of this checkout (kvctl-gpu:latest with gpus)
    gpus: tuple[str, str] | None = None  # device ids of P and D ("0", "0+1"); None: see DEFAULT_GPUS
    bind: str = DEFAULT_BIND  # host address the servers' ports are published on
    prefill_host: str | None = None  # engine URLs; None: $DOCKER_HOST or the local socket
    decode_host: str | None = None

    def host(self, role: str) -> str:
        return engine_url(self.prefill_host if role == "prefill" else self.decode_host)


def parse_gpus(value: str | list[str] | tuple[str, ...], field: str = "gpus") -> tuple[str, str]:
    """`P,D` (or a [P, D] list), each a device id or ids joined by '+': ("0", "1").

    Raises BadInput naming `field`.
    """
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    items = [i.strip() for i in items]
    if len(items) != 2 or not all(_GPU_RE.match(i) for i in items):
        raise BadInput(f"expected the GPUs of prefill and decode as P,D, got {value!r}", field=field,
                       fix="e.g. 0,1 (several per role: 0+1,2+3)")
    return items[0], items[1]


def docker_options(*, image: str | None = None, gpus: str | list[str] | None = None,
                   bind: str | None = None, prefill_host: str | None = None,
                   decode_host: str | None = None) -> DockerOptions:
    """Validated DockerOptions. Raises BadInput naming the field.

    A network engine with a loopback `bind` is refused: the servers would be
    reachable only on that other host.
    """
    bind = (bind or DEFAULT_BIND).strip()
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise BadInput(f"the bind address must be an IP address, got {bind!r}", field="bind",
                       fix="e.g. 127.0.0.1 (this host only) or 0.0.0.0 (every interface)") from None
    opts = DockerOptions(image=image or None, gpus=parse_gpus(gpus) if gpus else None, bind=bind,
                         prefill_host=prefill_host or None, decode_host=decode_host or None)
    for role in ROLES:
        remote = engine_hostname(opts.host(role))
        if remote and not is_loopback(remote) and is_loopback(bind):
            raise BadInput(f"the {role} engine {opts.host(role)} is another host, but ports are "
                           f"published on {bind}, its loopback", field=("bind", f"{role}_docker_host"),
                           fix="publish them on 0.0.0.0 (or that host's address)")
    return opts
