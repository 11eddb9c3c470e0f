"""The shipped scenarios, each with whether it is valid and whether this machine can run it.

"Runs here" is decided from what a run would need and this machine lacks
(`missing`): GPUs for a scenario that asks for devices, the docker engine and
the image for the docker runtime, the environment variables its model and
store paths name (nightly CI: $KVCTL_MODELS), and the V1 rig for a local
scenario with an engine v1 role. (The V0 rig is not listed: `kvctl scenario
run` installs it.) The probes are read-only and fast: `Host` runs each once
per listing, and tests pass their own.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvctl.errors import BadInput
from kvctl.provision.extras import Extra, ExtraVenv, needed_extras
from kvctl.provision.rig import default_spec
from kvctl.runtime import runtime_class, select_runtime
from kvctl.scenario.schema import Scenario, list_scenarios, load_scenario

# What shows a machine has NVIDIA GPUs: the driver's tool or its device nodes.
NVIDIA_SMI = "nvidia-smi"
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"
ENGINE_PROBE_TIMEOUT_S = 5  # seconds the docker engine gets to answer a ping


class Host:
    """What this machine has, each probe run at most once (the engine, the images, the rigs)."""

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = os.environ if env is None else env
        self._gpus: str | None | bool = False  # False: not probed yet
        self._engine: tuple[Any, str | None] | None = None
        self._images: dict[str, str | None] = {}
        self._rigs: dict[str, str | None] = {}

    def gpus_missing(self) -> str | None:
        """None when NVIDIA GPUs are visible, else why not."""
        if self._gpus is False:
            found = shutil.which(NVIDIA_SMI) or glob.glob(NVIDIA_DEVICES)
            self._gpus = None if found else f"no {NVIDIA_SMI} on PATH and no {NVIDIA_DEVICES} device"
        return self._gpus  # type: ignore[return-value]

    def _client(self) -> tuple[Any, str | None]:
        if self._engine is None:
            from kvctl.runtime.docker_engine import connect

            try:
                self._engine = (connect(None, timeout=ENGINE_PROBE_TIMEOUT_S), None)
            except BadInput as e:
                self._engine = (None, e.what)
        return self._engine

    def engine_missing(self) -> str | None:
        """None when the docker engine (DOCKER_HOST) answers, else why not."""
        return self._client()[1]

    def image_missing(self, ref: str) -> str | None:
        """None when the engine has image `ref`, else why not (the engine's own trouble first)."""
        if ref not in self._images:
            client, why = self._client()
            if client is None:
                self._images[ref] = why
            else:
                import docker.errors

                try:
                    client.images.get(ref)
                    self._images[ref] = None
                except docker.errors.ImageNotFound:
                    self._images[ref] = f"{ref} is not on the docker engine (`kvctl image build` makes it)"
                except docker.errors.APIError as e:
                    self._images[ref] = f"cannot look up {ref}: {e}"
        return self._images[ref]

    def default_image(self, gpus: bool, engine: str) -> str:
        """The image the docker runtime runs for vLLM `engine` when a scenario names none
        (the runtime's rule: the gpu image with GPUs, else the engine's cpu image)."""
        from kvctl.provision.images import cpu_repos, default_image

        if gpus:
            return default_image("gpu", engine)
        try:
            return default_image("cpu", engine)
        except BadInput:  # the CPU tag hashes this host's Debian base; elsewhere it has none
            return f"{cpu_repos(engine)[1]}:latest"

    def extra_missing(self, extra: Extra) -> str | None:
        """None when `extra` is installed beside its engine's rig, else why not (with the command)."""
        venv = ExtraVenv(extra, default_spec(extra.engine))
        return None if not venv.unfinished() else f"not installed: `{venv.install_command()}`"

    def rig_missing(self, engine: str) -> str | None:
        """None when `engine`'s rig (or its interpreter override) is there, else why not."""
        if engine not in self._rigs:
            from kvctl.runtime.local import engine_python

            try:
                engine_python(engine)
                self._rigs[engine] = None
            except BadInput as e:
                self._rigs[engine] = e.what
        return self._rigs[engine]


def _engines(s: Scenario) -> list[str]:
    """The vLLM engines the scenario's roles run, each once, prefill's first."""
    return list(dict.fromkeys(s.role(r).engine or s.engine for r in ("prefill", "decode")))


def missing_here(s: Scenario, runtime: str, host: Host) -> list[tuple[str, str]]:
    """(what, why) for each thing `s` needs on `runtime` that this machine lacks; [] = it runs here."""
    missing: list[tuple[str, str]] = []
    if s.attaches:
        return missing  # the attach file's cluster runs elsewhere; verify reads it from here
    if s.gpus and (why := host.gpus_missing()):
        missing.append(("GPUs", why))
    traits = runtime_class(runtime)
    if traits.docker_options:
        for engine in _engines(s):
            ref = s.image or host.default_image(bool(s.gpus), engine)
            if (why := host.image_missing(ref)) is not None:
                missing.append((f"image {ref}" if host.engine_missing() is None else "docker engine", why))
            if s.image:
                break  # one image for every role
    for field, value in (("model", s.model), ("store", s.store)):
        for var in dict.fromkeys(re.findall(r"\$\{?(\w+)\}?", value or "")):
            if not host.env.get(var):
                missing.append((f"${var}", f"{field} {value} uses ${var}, which is not set"))
    if traits.host_rigs:
        for engine in _engines(s):
            if engine != "v0" and (why := host.rig_missing(engine)):
                missing.append((f"{engine.upper()} rig", why))
        for extra in dict.fromkeys(e for r in ("prefill", "decode")
                                   for e in needed_extras(s.role(r).kv_transfer_config)):
            if (why := host.extra_missing(extra)) is not None:
                missing.append((f"{extra.name} extra", why))
    return missing


def describe_scenario(path: Path, host: Host | None = None) -> dict[str, Any]:
    """One row of `kvctl scenario list --json`: name, file, valid, runnable, missing, note (and more when valid:
    runtime, model, prompts, description, and `shape`, e.g. "2P2D", for a scenario that launches its cluster).

    `runnable` is true only when nothing is `missing` (short names: "GPUs",
    "image kvctl-gpu:latest", "docker engine", "$KVCTL_MODELS", "V1 rig");
    `note` says why for each.
    """
    row: dict[str, Any] = {"name": path.stem, "file": str(path)}
    try:
        s = load_scenario(str(path))
    except BadInput as e:
        return {**row, "valid": False, "runnable": False, "missing": [], "note": f"invalid: {e.what}"}
    row.update(name=s.name, valid=True, runtime=s.runtime, model=s.model, prompts=len(s.prompts),
               description=" ".join(s.description.split()))
    if not s.attaches:  # how many instances of each role it launches: "2P2D"
        row["shape"] = f"{s.role('prefill').count}P{s.role('decode').count}D"
    try:
        runtime, why = select_runtime(s.runtime)
    except BadInput as e:
        row.update(runnable=False, missing=[], note=e.what)
        return row
    missing = missing_here(s, runtime, host or Host())
    row.update(runnable=not missing, missing=[what for what, _ in missing],
               note=f"{runtime}: {why}" if not missing else "; ".join(f"{w}: {y}" for w, y in missing))
    return row


def describe_shipped(host: Host | None = None) -> list[dict[str, Any]]:
    """`describe_scenario` of every shipped scenario, sorted by file name (one `Host` for all)."""
    host = host or Host()
    return [describe_scenario(path, host) for path in list_scenarios()]
