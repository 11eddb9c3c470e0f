"""Docker engines: which one a role uses, connecting to it, reading its errors.

Engines are DOCKER_HOST-style URLs (unix://, tcp://, ssh://). The docker SDK
is imported only inside `connect`, so kvctl (and the options that name
engines) work without it installed. Image builds (kvctl.provision.images),
the docker runtime and its log follower all connect through here.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any
from urllib.parse import urlsplit

from kvctl.errors import BadInput

DEFAULT_SOCKET = "unix:///var/run/docker.sock"
API_TIMEOUT_S = 60.0  # one engine API call (streams use no timeout)
_REMOTE_SCHEMES = ("tcp", "ssh", "http", "https")


def engine_url(host: str | None) -> str:
    """The engine URL kvctl uses for `host` (None: $DOCKER_HOST, else the local socket)."""
    return host or os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET


def engine_hostname(url: str) -> str | None:
    """The host name of a network engine URL; None for a local socket."""
    parts = urlsplit(url)
    if parts.scheme not in _REMOTE_SCHEMES:
        return None
    return parts.hostname


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect(host: str | None, timeout: float | None = API_TIMEOUT_S) -> Any:
    """A docker SDK client for engine `host` that answered a ping.

    Raises BadInput when the SDK is not installed or no engine answers.
    """
    try:
        import docker
    except ModuleNotFoundError:
        raise BadInput("the docker runtime needs the Python docker SDK", where="python",
                       fix="pip install 'kvctl[docker]'") from None
    url = engine_url(host)
    try:
        client = docker.DockerClient(base_url=url, timeout=timeout,
                                     use_ssh_client=url.startswith("ssh://"))
        client.ping()
    except docker.errors.DockerException as e:
        raise BadInput(f"no Docker engine answers at {url}: {e}", where="DOCKER_HOST",
                       fix="start dockerd (scripts/ensure-docker.sh does it on Debian), or point "
                           "DOCKER_HOST, or the prefill or decode docker host, at a running "
                           "engine") from None
    return client


def daemon_error(e: Exception) -> str:
    """The engine's own words for a failed API call."""
    return str(getattr(e, "explanation", None) or e).strip()
