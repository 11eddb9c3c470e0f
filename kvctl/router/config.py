"""What a router serves: its instances, policy, address, timeouts. Validated, pure.

Instances are given per role as URLs, optionally named (`name=URL`); unnamed ones
are called `prefill-0`, `prefill-1`, ... and `decode-0`, ... in the order given,
the names `kvctl launch` gives its instances. Every tunable has its default here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvctl.errors import BadInput

POLICIES = ("round_robin", "least_outstanding")

DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise
API_KEY_ENV = "KVCTL_ROUTER_API_KEY"  # the router process's API key, from its environment (never argv)
DEFAULT_POLICY = "round_robin"
HEALTH_INTERVAL_S = 1.0  # how often each instance's /health is polled
HEALTH_TIMEOUT_S = 2.0  # one /health request
# A /health check that times out marks a healthy instance unhealthy only once its last 200 is
# this old: on 2 loaded cores (load average ~30) live vLLM servers missed the 2 s check for up
# to 11 s in a row (checks every 3 s), while serving; a refusal or a non-200 answer counts at once.
HEALTH_GRACE_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # opening a connection to an instance
PREFILL_TIMEOUT_S = 300.0  # a whole prefill request (a long prompt on 2 CPU cores takes seconds)
DECODE_IDLE_TIMEOUT_S = 300.0  # longest silence from D between two chunks (no limit on the total)
KEEPALIVE_S = 4.0  # idle upstream connections are dropped before uvicorn's 5 s keep-alive does

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class InstanceConfig:
    name: str  # prefill-0, decode-1, or the name given as name=URL
    role: str  # prefill | decode
    url: str  # base URL without a trailing slash, e.g. http://127.0.0.1:8100


@dataclass(frozen=True)
class RouterConfig:
    """A validated router configuration (build it with `build_config`)."""

    prefill: tuple[InstanceConfig, ...]
    decode: tuple[InstanceConfig, ...]
    host: str = DEFAULT_HOST
    port: int = 0  # 0: a free port, chosen when the router starts
    api_key: str | None = None  # when set, /v1/* requires `Authorization: Bearer <api_key>`
    # True: P is asked for kv_transfer_params and D gets the ones P answered with (NIXL;
    # bodies.py has the rule); a P answer without them is a 502 naming P.
    kv_transfer_params: bool = False
    policy: str = DEFAULT_POLICY
    health_interval_s: float = HEALTH_INTERVAL_S
    health_timeout_s: float = HEALTH_TIMEOUT_S
    health_grace_s: float = HEALTH_GRACE_S
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    prefill_timeout_s: float = PREFILL_TIMEOUT_S
    decode_idle_timeout_s: float = DECODE_IDLE_TIMEOUT_S
    instances: dict[str, InstanceConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", {i.name: i for i in (*self.prefill, *self.decode)})


def parse_instance(text: str, role: str, index: int) -> InstanceConfig:
    """One instance as given: `URL` (named `<role>-<index>`) or `name=URL`.

    Raises BadInput (field = the role) for a URL that is not http(s)://host[:port]
    or a name unfit for logs and headers.
    """
    name, url = f"{role}-{index}", text.strip()
    head, sep, tail = url.partition("=")
    if sep and "://" not in head:
        name, url = head.strip(), tail.strip()
        if not _NAME_RE.match(name):
            raise BadInput(f"invalid {role} instance name {name!r} in {text!r}", field=role,
                           fix="use letters, digits, '.', '_' or '-' (at most 63), e.g. "
                               f"{role}-a=http://127.0.0.1:8100")
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment:
        raise BadInput(f"invalid {role} instance URL {url!r}", field=role,
                       fix="give the server's base URL, e.g. http://127.0.0.1:8100 "
                           f"(optionally named: {role}-a=http://127.0.0.1:8100)")
    return InstanceConfig(name=name, role=role, url=url.rstrip("/"))


def build_config(prefill: Sequence[str], decode: Sequence[str], *, host: str = DEFAULT_HOST,
                 port: int = 0, api_key: str | None = None, kv_transfer_params: bool = False,
                 policy: str = DEFAULT_POLICY,
                 health_interval_s: float = HEALTH_INTERVAL_S,
                 health_timeout_s: float = HEALTH_TIMEOUT_S,
                 health_grace_s: float = HEALTH_GRACE_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 prefill_timeout_s: float = PREFILL_TIMEOUT_S,
                 decode_idle_timeout_s: float = DECODE_IDLE_TIMEOUT_S) -> RouterConfig:
    """A RouterConfig from instances as people type them (see `parse_instance`).

    Raises BadInput naming the field at fault: an empty pool (`prefill`, `decode`),
    a duplicate instance name or URL, an unknown `policy`, a `port` outside 0-65535,
    an empty `api_key`, a timeout or interval that is not positive, a negative `health_grace`.
    """
    pools = {}
    for role, given in (("prefill", prefill), ("decode", decode)):
        if not given:
            raise BadInput(f"no {role} instance given", field=role,
                           fix=f"name at least one {role} server's URL, e.g. http://127.0.0.1:8100")
        pools[role] = tuple(parse_instance(text, role, i) for i, text in enumerate(given))
    seen_names: dict[str, str] = {}
    seen_urls: dict[str, str] = {}
    for inst in (*pools["prefill"], *pools["decode"]):
        if inst.name in seen_names:
            raise BadInput(f"instance name {inst.name!r} is used twice", field=inst.role,
                           fix="give each instance its own name (name=URL)")
        if inst.url in seen_urls:
            raise BadInput(f"{inst.url} is given twice ({seen_urls[inst.url]} and {inst.name})",
                           field=inst.role, fix="give each server once, in one role")
        seen_names[inst.name] = inst.role
        seen_urls[inst.url] = inst.name
    if policy not in POLICIES:
        raise BadInput(f"unknown policy {policy!r}", field="policy", fix=f"use one of: {', '.join(POLICIES)}")
    if not 0 <= port < 65536:
        raise BadInput(f"port must be 0-65535, got {port}", field="port",
                       fix="give a free port, or 0 for any free one")
    if api_key is not None and not api_key.strip():
        raise BadInput("the API key is empty", field="api_key", fix="give a non-empty key, or none")
    for name, value in (("health_interval", health_interval_s), ("health_timeout", health_timeout_s),
                        ("connect_timeout", connect_timeout_s), ("prefill_timeout", prefill_timeout_s),
                        ("decode_idle_timeout", decode_idle_timeout_s)):
        if not value > 0:
            raise BadInput(f"{name} must be a positive number of seconds, got {value}", field=name,
                           fix="give seconds greater than 0")
    if not health_grace_s >= 0:
        raise BadInput(f"health_grace must be 0 or more seconds, got {health_grace_s}", field="health_grace",
                       fix="give seconds (0: a timed-out check marks the instance unhealthy at once)")
    return RouterConfig(prefill=pools["prefill"], decode=pools["decode"], host=host, port=port,
                        api_key=api_key, kv_transfer_params=kv_transfer_params, policy=policy,
                        health_interval_s=health_interval_s,
                        health_timeout_s=health_timeout_s, health_grace_s=health_grace_s,
                        connect_timeout_s=connect_timeout_s,
                        prefill_timeout_s=prefill_timeout_s, decode_idle_timeout_s=decode_idle_timeout_s)
