"""AttachedRuntime: the servers of a cluster kvctl did not start (`kvctl attach`).

Its clusters run elsewhere (another machine, Kubernetes, a user's own vLLM):
kvctl knows each server only by its URL and, when the attach file names one,
a log file. So an instance's status is its /health answer, its logs are that
file, and nothing is ever started, stopped or killed: `down` refuses such a
cluster (`kvctl detach` forgets it), and so do the fault bench and a launch
under its name (`starts_servers` is False).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx

from kvctl.errors import BadInput
from kvctl.net import answers_health
from kvctl.runtime.base import InstanceSpec, InstanceStatus, LaunchPlan, ServiceSpec, StopResult, instance_logs

NAME = "attached"  # cluster.json's `runtime` of a cluster kvctl did not start


def _not_ours(what: str, url: str) -> BadInput:
    return BadInput(f"the {what} server at {url} was not started by kvctl; it is not stopped",
                    fix="stop it where it was started")


class AttachedInstance:
    """A server of a cluster kvctl did not start: seen through /health, never stopped."""

    def __init__(self, name: str, role: str, url: str, log_path: Path):
        self.name, self.role, self.url, self.log_path = name, role, url, log_path

    def __repr__(self) -> str:
        return f"<AttachedInstance {self.name} {self.url}>"

    def status(self) -> InstanceStatus:
        with httpx.Client() as client:
            if answers_health(client, self.url):
                return InstanceStatus(True, detail="attached: /health answers", healthy=True)
        return InstanceStatus(False, detail="attached: /health does not answer", healthy=False)

    def stop(self, grace_s: float = 10.0) -> StopResult:
        raise _not_ours(self.name, self.url)

    def kill(self) -> None:
        raise _not_ours(self.name, self.url)

    def logs(self, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        return instance_logs(self, tail, follow)

    def record(self) -> dict[str, Any]:
        return {}


class AttachedRuntime:
    """Re-attaches to the servers an attach file named; starts none."""

    name: ClassVar[str] = NAME
    starts_servers: ClassVar[bool] = False
    host_rigs: ClassVar[bool] = False
    docker_options: ClassVar[bool] = False

    @classmethod
    def for_cluster(cls, plan: LaunchPlan) -> AttachedRuntime:
        return cls()

    def _refuse(self) -> BadInput:
        return BadInput("the attached runtime starts no servers", field="runtime",
                        fix="attach a running cluster with `kvctl attach`, or launch with the local or "
                            "docker runtime")

    def check(self) -> None:
        raise self._refuse()

    def check_instance(self, spec: InstanceSpec) -> None:
        raise self._refuse()

    def start(self, spec: InstanceSpec) -> AttachedInstance:
        raise self._refuse()

    def start_service(self, spec: ServiceSpec) -> AttachedInstance:
        raise self._refuse()

    def service_host(self, service: ServiceSpec, client: InstanceSpec) -> str:
        raise self._refuse()

    def attach(self, name: str, role: str, url: str, log_path: Path,
               record: Mapping[str, Any]) -> AttachedInstance:
        return AttachedInstance(name, role, url, log_path)

    def remove_leftovers(self, cluster: str, records: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        return []
