"""Extras: what a third-party connector needs beside the read-only rig, one venv per extra.

An extra is a named set of pinned packages (NIXL for vLLM's NixlConnector, ...)
that the rig does not hold. Each is installed into its own venv layered on the
rig of its engine (`rig.layered_venv`: it sees the rig's torch and vLLM, and its
pip.conf pins every rig package, so nothing there can shadow one), then checked
by the extra's own verify script. The rig stays as built. A server whose
kv-transfer config names a connector of an extra gets that extra's site-packages
on its PYTHONPATH, after the overlay (`server_sites`).

    $KVCTL_HOME/extras/<name>-<hash12>/
        venv/               layered on the rig; its site-packages is what servers get
        steps/<step>.json   completion markers, as a rig's (rig.Rig)
        install.log
        .lock

The hash covers the extra's inputs (its pip installs, verify script and env)
and the interpreter of the rig under it (its path names the rig's own key): new
pins or a new rig give a new directory, a second install of the same returns at
once from the markers. Extras live in the home of their rig, so a KVCTL_HOME of
its own that reaches the rig through $KVCTL_RIG_V1_PYTHON (tests) finds them. Adding an extra is
one more entry in EXTRAS.

No torch, no vLLM: standard library and the pure topology reader.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from connectors.config.topology import connector_names
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home
from kvctl.provision import rig
from kvctl.subprocesses import TAIL_LINES


@dataclass(frozen=True)
class PipInstall:
    """One `pip install` into the extra's venv."""

    packages: tuple[str, ...]
    deps: bool = True  # False: --no-deps (the packages' own requirements are not resolved)


@dataclass(frozen=True)
class Extra:
    """Everything an extra is built from; all of it keys its directory."""

    name: str
    engine: str  # the rig it is layered on
    summary: str
    installs: tuple[PipInstall, ...]
    connectors: tuple[str, ...]  # kv_connector names whose servers need it
    # Python run with the venv's interpreter (-I); it prints one line
    # `KVCTL_VERIFY {"ok": bool, "problem": str, ...}`.
    verify: str
    verify_env: tuple[tuple[str, str], ...] = ()

    def inputs(self) -> dict:
        return {"name": self.name, "engine": self.engine,
                "installs": [asdict(i) for i in self.installs],
                "verify": self.verify, "verify_env": [list(kv) for kv in self.verify_env]}

    def pins(self) -> str:
        """The installs as one would type them: `a==1 b==2 (--no-deps)`."""
        return "; ".join(" ".join(i.packages) + ("" if i.deps else " (--no-deps)")
                         for i in self.installs)


# ---- the extras ---------------------------------------------------------------------
# UCX transports that work between processes on one host without a NIC or GPU: tcp for
# messages (loopback), cma for zero-copy DRAM reads. `sm` or `posix` alone fail at
# backend creation.
UCX_TLS = "tcp,cma"

# A real transfer, as NixlConnector does on CPU: two agents with the UCX backend,
# DRAM registered as (address, length, device, meta), one READ of 256 KiB compared
# byte for byte.
_NIXL_VERIFY = r"""
import json, time
r = {"ok": False, "problem": ""}
try:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    import nixl_cu12
    r["nixl"] = nixl_cu12.__name__
    cfg = nixl_agent_config(backends=["UCX"])
    reader, owner = nixl_agent("kvctl-verify-reader", cfg), nixl_agent("kvctl-verify-owner", cfg)
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    reader.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    owner.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    peer = reader.add_remote_agent(owner.get_agent_metadata())
    xfer = reader.initialize_xfer("READ", reader.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
                                  owner.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"),
                                  peer, b"kvctl-verify")
    state = reader.transfer(xfer)
    deadline = time.monotonic() + 20
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = reader.check_xfer_state(xfer)
        time.sleep(0.01)
    r["backend"] = reader.query_xfer_backend(xfer)
    r["bytes"] = int(src.nbytes)
    if state != "DONE":
        r["problem"] = f"a UCX READ between two agents ended {state!r}, not 'DONE'"
    elif not (src == dst).all():
        r["problem"] = "a UCX READ between two agents returned other bytes than were sent"
    else:
        r["ok"] = True
except Exception as e:
    r["problem"] = f"{type(e).__name__}: {e}"
print("KVCTL_VERIFY " + json.dumps(r))
"""

NIXL = Extra(
    name="nixl", engine="v1",
    summary="NIXL with UCX for vLLM's NixlConnector",
    # nixl-cu12 bundles UCX and needs no CUDA runtime wheels; vLLM imports nixl._api,
    # which is in the `nixl` meta package: --no-deps, else it pulls nixl-cu13 too.
    installs=(PipInstall(("nixl-cu12==1.5.1",)), PipInstall(("nixl==1.5.1",), deps=False)),
    connectors=("NixlConnector", "NixlPullConnector", "NixlPushConnector"),
    verify=_NIXL_VERIFY, verify_env=(("UCX_TLS", UCX_TLS),))

# The server's and the connector's modules import (the connector's pulls in vLLM: ~15 s).
_LMCACHE_VERIFY = r"""
import json
r = {"ok": False, "problem": ""}
try:
    import importlib.metadata as md
    import aiofile, sortedcontainers, opentelemetry.exporter.prometheus
    import lmcache.cli.main, lmcache.v1.multiprocess.server
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
    r["lmcache"] = md.version("lmcache")
    r["ok"] = True
except Exception as e:
    r["problem"] = f"{type(e).__name__}: {e}"
print("KVCTL_VERIFY " + json.dumps(r))
"""

LMCACHE = Extra(
    name="lmcache", engine="v1",
    summary="LMCache 0.5.6 for LMCacheMPConnector and its `lmcache server` (multi-process mode)",
    # A full resolve cannot satisfy the rig (numpy<=2.2.6 against its 2.3.5) and would touch 46
    # packages (protobuf, grpcio, prometheus_client downgrades, cupy-cuda13x, cuda-python):
    # lmcache --no-deps, then what its server and connector import that the rig lacks. 96 MB.
    installs=(PipInstall(("lmcache==0.5.6",), deps=False),
              PipInstall(("sortedcontainers==2.4.0", "aiofile==3.12.3", "caio==0.12.10",
                          "opentelemetry-exporter-prometheus==0.66b2"))),
    # LMCacheConnectorV1 imports lmcache too (it has no CPU path: validate warns, see
    # connectors.config.validate LMCACHE_V1_ON_CPU); kvctl runs servers only for the MP connector.
    connectors=("LMCacheMPConnector", "LMCacheConnectorV1"),
    verify=_LMCACHE_VERIFY)

EXTRAS: dict[str, Extra] = {e.name: e for e in (NIXL, LMCACHE)}
# -----------------------------------------------------------------------------------------


def get_extra(name: str) -> Extra:
    """The extra called `name`. Raises BadInput (field `extra`) for an unknown one."""
    try:
        return EXTRAS[name]
    except KeyError:
        raise BadInput(f"unknown extra {name!r}", field="extra",
                       fix=f"use one of: {', '.join(EXTRAS)}") from None


def extras_for_engine(engine: str) -> list[Extra]:
    return [e for e in EXTRAS.values() if e.engine == engine]


def needed_extras(kv_transfer_config: object) -> list[Extra]:
    """The extras a server with this kv-transfer config needs (its connector, or a child's)."""
    names = set(connector_names(kv_transfer_config))
    return [e for e in EXTRAS.values() if names & set(e.connectors)]


class ExtraVenv(rig.Rig):
    """An extra's directory and markers, layered on the rig of `rig_spec`."""

    def __init__(self, extra: Extra, rig_spec: rig.RigSpec, home: Path | None = None):
        self.spec = rig_spec  # its pip_args (a mirror) and constraints apply here too
        self.extra = extra
        self.rig_spec = rig_spec
        # The rig under it is its interpreter: the installed rig's, or the one an override
        # ($KVCTL_RIG_V1_PYTHON) names. Its directory names the rig's inputs.
        python = Path(os.environ.get(rig.PYTHON_ENVS[rig_spec.engine])
                      or rig.Rig(rig_spec, home).python).absolute()
        self._key = rig.digest({"extra": extra.inputs(), "rig": str(python)})[:12]
        self._locate(_home_of(python, home) / "extras" / f"{extra.name}-{self._key}")

    @property
    def steps(self) -> tuple[rig._Step, ...]:
        return STEPS

    def key(self) -> str:
        return self._key

    def what(self) -> str:
        return f"extra {self.extra.name!r}"

    def install_command(self) -> str:
        return f"kvctl rig install --engine {self.extra.engine} --extra {self.extra.name}"

    def site(self) -> Path:
        """Its site-packages: what goes on a server's PYTHONPATH."""
        return self.site_packages()


def _home_of(python: Path, home: Path | None) -> Path:
    """Where the extras of the rig whose interpreter is `python` live: beside that rig (a
    `<home>/rigs/<rig>/venv/bin/python` found through an override, as tests with their own
    KVCTL_HOME use it, keeps its extras in <home>), else in `home` or $KVCTL_HOME."""
    parents = python.parents
    if len(parents) > 4 and parents[3].name == "rigs" and parents[1].name == "venv":
        return parents[4]
    return home or kvctl_home()


def _step_venv(ctx) -> str:
    made = rig.layered_venv(ctx.rig.venv, ctx.rig.rig_spec)
    return f"{made.action}, layered on {made.rig_site}"


def _step_install(ctx) -> str:
    for item in ctx.rig.extra.installs:
        ctx.pip(*(() if item.deps else ("--no-deps",)), *item.packages)
    size = rig.disk_usage(ctx.rig.site())
    return f"{ctx.rig.extra.pins()}: {size / 1e6:.0f} MB"


def _step_verify(ctx) -> str:
    extra: Extra = ctx.rig.extra
    # -I leaves PYTHONPATH out: the script sees the venv and the rig under it, nothing else.
    env = {**os.environ, "PYTHONNOUSERSITE": "1", **dict(extra.verify_env)}
    out = ctx.run([str(ctx.rig.python), "-I", "-c", extra.verify], env=env, label="verify script")
    found = [line for line in out.splitlines() if line.startswith("KVCTL_VERIFY ")]
    if not found:
        raise ctx.fail("the check script printed no result", "\n".join(out.splitlines()[-TAIL_LINES:]))
    result = json.loads(found[-1][len("KVCTL_VERIFY "):])
    if not result.get("ok"):
        raise ctx.fail(result.get("problem") or "the check failed",
                       "\n".join(out.splitlines()[-TAIL_LINES:]))
    env_note = " ".join(f"{k}={v}" for k, v in extra.verify_env)
    return ", ".join(f"{k} {v}" for k, v in result.items() if k not in ("ok", "problem")) + \
        (f" ({env_note})" if env_note else "")


STEPS: tuple[rig._Step, ...] = (
    rig._Step("venv", "create the venv layered on the rig", _step_venv),
    rig._Step("install", "install the extra's packages", _step_install),
    rig._Step("verify", "verify the extra works", _step_verify),
)


@dataclass
class ExtraInfo:
    name: str
    path: Path
    site: Path
    log: Path
    steps: list[rig.StepResult]
    total_s: float
    waited_s: float

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "site": str(self.site),
                "log": str(self.log), "total_s": round(self.total_s, 3),
                "waited_s": round(self.waited_s, 3),
                "steps": [asdict(s) | {"seconds": round(s.seconds, 3)} for s in self.steps]}


def install_extra(extra: Extra, rig_spec: rig.RigSpec | None = None,
                  progress: rig.Progress | None = None, home: Path | None = None) -> ExtraInfo:
    """Build (or finish) `extra` on the rig of `rig_spec` (default: its engine's).

    Steps already done for the same inputs are skipped: a complete extra returns at
    once. Raises BadInput when the rig is not installed (`rig.rig_python`),
    RuntimeFailure naming the failed step.
    """
    rig_spec = rig_spec or rig.default_spec(extra.engine)
    check_engines([extra], rig_spec)
    venv = ExtraVenv(extra, rig_spec, home)
    start = time.monotonic()
    results, waited = rig.build(venv, progress, f"another install is building the extra {extra.name!r}")
    return ExtraInfo(name=extra.name, path=venv.dir, site=venv.site(), log=venv.log, steps=results,
                     total_s=time.monotonic() - start, waited_s=waited)


def check_engines(wanted: list[Extra], rig_spec: rig.RigSpec) -> None:
    """Raises BadInput (field `extra`) for an extra that is not for the rig's engine."""
    for extra in wanted:
        if rig_spec.engine != extra.engine:
            raise BadInput(f"the extra {extra.name!r} is for engine {extra.engine}, not {rig_spec.engine}",
                           field="extra", fix=f"install it on the engine {extra.engine} rig")


def extra_status(extra: Extra, rig_spec: rig.RigSpec | None = None, home: Path | None = None) -> dict:
    """Where the extra is, its steps, size, pins and which connectors need it."""
    rig_spec = rig_spec or rig.default_spec(extra.engine)
    venv = ExtraVenv(extra, rig_spec, home)
    steps = rig.step_status(venv)
    installed = all(s["state"] == "done" for s in steps)
    site = next(iter(sorted(venv.venv.glob("lib/python*/site-packages"))), None)
    return {"name": extra.name, "summary": extra.summary, "engine": extra.engine,
            "path": str(venv.dir), "key": venv.key(), "installed": installed,
            "site": str(site) if site else None, "log": str(venv.log),
            "size_bytes": rig.disk_usage(site) if installed and site else 0,
            "pins": extra.pins(), "connectors": list(extra.connectors),
            "verify_env": dict(extra.verify_env), "steps": steps,
            "install": venv.install_command()}


def server_sites(kv_transfer_config: object, engine: str, home: Path | None = None) -> list[Path]:
    """The site-packages of every extra a server with this config needs, in EXTRAS order.

    Raises BadInput naming the extra and the command that installs it when one is
    missing, or when a connector's extra is not for the server's engine.
    """
    sites = []
    for extra in needed_extras(kv_transfer_config):
        connector = ", ".join(sorted(set(extra.connectors) & set(connector_names(kv_transfer_config))))
        if extra.engine != engine:
            raise BadInput(f"{connector} needs the extra {extra.name!r}, which runs on engine "
                           f"{extra.engine}, not {engine}", field="engine",
                           fix=f"run this server on engine {extra.engine}")
        sites.append(_installed(extra, connector, home).site())
    return sites


def extra_python(name: str, needed_by: str) -> Path:
    """The interpreter of the installed extra `name` (its venv, layered on its engine's rig).

    Raises BadInput naming what needs it (`needed_by`) and the command that installs it.
    """
    return _installed(get_extra(name), needed_by).python


def _installed(extra: Extra, needed_by: str, home: Path | None = None) -> ExtraVenv:
    """`extra`'s venv on its engine's rig; raises BadInput naming `needed_by` when it is not installed."""
    venv = ExtraVenv(extra, rig.default_spec(extra.engine), home)
    if venv.unfinished():
        raise BadInput(f"{needed_by} needs the extra {extra.name!r} ({extra.summary}), which is not installed",
                       where=str(venv.dir), fix=f"run `{venv.install_command()}` (once; it keeps the steps done)")
    return venv
