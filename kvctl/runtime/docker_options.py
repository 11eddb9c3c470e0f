"""The docker-only part of a cluster spec, validated: image, GPUs, bind address, engines.

GPUs are given per instance: a list per instance in order (`0,1` for 1P1D's
P and D, `0,1,2` for prefill-0, prefill-1, decode-0) or by name
(`prefill-0=0,decode-0=1+2`). `parse_gpus` checks the form; `gpu_lists`
matches them to a cluster's instances (the spec does it before anything
starts, the docker runtime when it starts each container).

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

_IDS_RE = re.compile(r"^\d+(\+\d+)*$")  # one instance's device ids: 0, or 0+1
_GPUS_FIX = ("one device list per instance, in order (prefills first): 0,1,2; or by name: "
             "prefill-0=0,prefill-1=1,decode-0=2+3 (several devices of one instance joined by '+')")


@dataclass(frozen=True)
class DockerOptions:
    """The docker-only parts of a cluster spec."""

    image: str | None = None  # None: the cpu image of this checkout (kvctl-gpu:latest with gpus)
    # Device ids per instance as given (see parse_gpus): ("0", "1"), or ("prefill-0=0", ...);
    # None: on a GPU image instance i gets device i (default_gpu_lists), on the cpu image none.
    gpus: tuple[str, ...] | None = None
    bind: str = DEFAULT_BIND  # host address the servers' ports are published on
    prefill_host: str | None = None  # engine URLs; None: $DOCKER_HOST or the local socket
    decode_host: str | None = None

    def host(self, role: str) -> str:
        return engine_url(self.prefill_host if role == "prefill" else self.decode_host)


def parse_gpus(value: str | list[str] | tuple[str, ...], field: str = "gpus") -> tuple[str, ...]:
    """GPU lists as people write them, checked for form only: a tuple of items.

    `value` is a string of comma-separated items, or a list of such strings
    (a repeated option, a YAML list). Every item is either a device list
    (`0`, `0+1`), given in instance order, or `NAME=DEVICES` (`decode-0=2+3`);
    the two forms do not mix. `gpu_lists` matches them to the instances.
    Raises BadInput naming `field`.
    """
    parts = [value] if isinstance(value, str) else [str(v) for v in value]
    items = []
    for raw in (i for part in parts for i in part.split(",")):
        name, sep, ids = (x.strip() for x in raw.partition("="))
        if not _IDS_RE.match(ids if sep else name) or (sep and not name):
            raise BadInput(f"not a GPU list: {raw.strip()!r} (in {','.join(parts)!r})", field=field,
                           fix=_GPUS_FIX)
        items.append(f"{name}={ids}" if sep else name)
    named = [i.partition("=")[0] for i in items if "=" in i]
    if named and len(named) != len(items):
        raise BadInput(f"GPU lists mix names and positions: {','.join(items)}", field=field,
                       fix="name every instance (prefill-0=0,decode-0=1) or none (0,1)")
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:
        raise BadInput(f"GPUs given twice for {', '.join(twice)}", field=field,
                       fix="give each instance one device list (several devices: 0+1)")
    return tuple(items)


def gpu_lists(gpus: tuple[str, ...], names: list[str] | tuple[str, ...],
              field: str = "gpus") -> dict[str, list[str]]:
    """Each instance's device ids, by name, from parse_gpus' items.

    `names` are the cluster's instances in order (prefill, decode for 1P1D;
    prefill-0, ..., decode-0, ... for pools). Positional items go to them in
    that order; named items to the instance named. Raises BadInput naming
    `field` for a count mismatch, an unknown name or an instance left without.
    """
    listed = ", ".join(names)
    if all("=" in i for i in gpus):
        given = dict(i.split("=", 1) for i in gpus)
        unknown = [n for n in given if n not in names]
        if unknown:
            raise BadInput(f"GPUs for {', '.join(unknown)}: no such instance (the instances are {listed})",
                           field=field, fix=f"name instances of this cluster: {listed}")
        missing = [n for n in names if n not in given]
        if missing:
            raise BadInput(f"no GPUs for {', '.join(missing)}: every instance needs its own list "
                           f"(the instances are {listed})", field=field,
                           fix=f"give each of {listed} a device list, e.g. "
                               + ",".join(f"{n}={k}" for k, n in enumerate(names)))
        return {n: given[n].split("+") for n in names}
    if len(gpus) != len(names):
        raise BadInput(f"{len(gpus)} GPU list{'s' if len(gpus) != 1 else ''} for {len(names)} instances "
                       f"({listed})", field=field,
                       fix=f"give one device list per instance in this order: {listed}, e.g. "
                           + ",".join(str(k) for k in range(len(names))))
    return {n: g.split("+") for n, g in zip(names, gpus)}


def default_gpu_lists(names: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """On a GPU image without given GPUs: instance i (in `names` order) gets device i."""
    return {n: [str(k)] for k, n in enumerate(names)}


def docker_options(*, image: str | None = None, gpus: str | list[str] | tuple[str, ...] | None = None,
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
