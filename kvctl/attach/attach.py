"""Register a cluster kvctl did not start, and forget it again.

`attach_cluster` checks what it is given (URLs, log files that exist, a store
directory that is visible), asks the first prefill's `/v1/models` for the
served model name when it was not given, and writes cluster.json with
`managed: false` (kvctl.cluster.state). It starts, stops and changes nothing.
An instance's log is a file on this host or `cmd:COMMAND`; verify streams a
command's output into `CLUSTER_DIR/logs/NAME.log` while it runs, so that is
the record's `log_path`. No log source, or no store: the checks that need them
are reported as not observable.

`detach_cluster` removes an attached cluster's state and captured logs and
refuses a cluster kvctl launched (`kvctl down` stops those).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvctl.attach.file import AttachFile, AttachFileInstance, read_attach_file
from kvctl.client import auth_headers
from kvctl.cluster.state import (
    API_KEY_ENV,
    ATTACHED_RUNTIME,
    STATE_FILE,
    ClusterState,
    InstanceRecord,
    LogSource,
    cluster_dir,
    load_cluster,
    save_cluster,
    save_store_keys,
    utc_now,
    validate_cluster_name,
)
from kvctl.errors import BadInput

log = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 10.0  # one GET /v1/models when asking the served model name
ATTACH_FILE = "attach.yaml"  # the attach file inside a rendered deployment's directory


@dataclass(frozen=True)
class AttachInstance:
    """One server of an attached cluster: its name (cluster.json key), role, URL, log."""

    name: str
    role: str  # prefill | decode
    url: str
    log: LogSource | None = None  # None: its log is not observable from here
    kv_transfer_config: dict | None = None


@dataclass(frozen=True)
class AttachSpec:
    name: str
    instances: tuple[AttachInstance, ...]
    served_model_name: str | None = None  # None: ask the first prefill's /v1/models
    model: str | None = None
    endpoint: str | None = None
    store: Path | None = None  # None: not visible from here
    source: str | None = None  # the attach file, for messages
    # The cluster's store keys (first signs), for checks: verify and inspect-store check entries'
    # tags with them. Kept in CLUSTER_DIR/store_key (0600). (): not given.
    store_keys: tuple[str, ...] = field(default=(), repr=False)


@dataclass
class AttachResult:
    state: ClusterState
    notes: list[str] = field(default_factory=list)  # what will not be observable, and why


def _url(value: str | None, field_name: str) -> str:
    url = (value or "").strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+$", url):
        raise BadInput(f"{value!r} is not a server's base URL", field=field_name,
                       fix="use http://HOST:PORT as reachable from here, e.g. http://10.0.0.5:8000")
    return url


def spec_from_options(name: str, *, prefill: str, decode: str, prefill_log: str | None = None,
                      decode_log: str | None = None, store: Path | None = None, endpoint: str | None = None,
                      model_name: str | None = None) -> AttachSpec:
    """A 1P1D AttachSpec (instances `prefill` and `decode`). Raises BadInput naming the field."""
    instances = (
        AttachInstance("prefill", "prefill", _url(prefill, "prefill"),
                       LogSource.parse(prefill_log, "prefill_log") if prefill_log is not None else None),
        AttachInstance("decode", "decode", _url(decode, "decode"),
                       LogSource.parse(decode_log, "decode_log") if decode_log is not None else None),
    )
    return AttachSpec(name=validate_cluster_name(name), instances=instances,
                      served_model_name=model_name or None,
                      endpoint=_url(endpoint, "endpoint") if endpoint else None,
                      store=Path(store).expanduser().absolute() if store is not None else None)


def spec_from_file(path: Path, name: str | None = None) -> AttachSpec:
    """The AttachSpec of an attach file (or a rendered deployment's directory holding one).

    `name` overrides the file's `name`. Relative paths are relative to the
    file's directory. Raises BadInput: every problem of the file, or no name.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / ATTACH_FILE
    if not path.is_file():
        raise BadInput(f"attach file {path} does not exist", where=str(path.absolute()),
                       fix=f"give an attach file, or the directory `kvctl render k8s` wrote ({ATTACH_FILE})")
    parsed: AttachFile = read_attach_file(path)
    chosen = name or parsed.name
    if not chosen:
        raise BadInput("the attached cluster needs a name", field="name", where=str(path),
                       fix="name it on the command line, or add `name:` to the file")
    base = path.parent.absolute()

    def source(i: AttachFileInstance) -> LogSource | None:
        if i.log is None or not i.log.strip():
            return None
        src = LogSource.parse(i.log, "log")
        if src.path is not None and not Path(i.log).expanduser().is_absolute():
            src = LogSource(path=base / Path(i.log).expanduser())
        return src

    store = None
    if parsed.store is not None:
        store = Path(parsed.store).expanduser()
        store = store if store.is_absolute() else base / store
    return AttachSpec(name=validate_cluster_name(chosen),
                      instances=tuple(AttachInstance(i.name, i.role, i.url, source(i), i.kv_transfer_config)
                                      for i in parsed.instances),
                      served_model_name=parsed.served_model_name, model=parsed.model,
                      endpoint=parsed.endpoint, store=store, source=str(path))


def served_model_name(url: str) -> tuple[str, str | None]:
    """(served name, model root) from `url`'s /v1/models (with $KVCTL_API_KEY, when set, as
    `Authorization: Bearer`). Raises BadInput (field `model_name`)."""
    try:
        r = httpx.get(f"{url}/v1/models", timeout=MODELS_TIMEOUT_S,
                      headers=auth_headers(os.environ.get(API_KEY_ENV)))
        r.raise_for_status()
        first = r.json()["data"][0]
        return str(first["id"]), (str(first["root"]) if first.get("root") else None)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BadInput(f"cannot learn the served model name from {url}/v1/models: {e or type(e).__name__}",
                       field="model_name",
                       fix="give the served model name, or make the prefill server reachable from here") from None


def _located(spec: AttachSpec, field_name: str, path: str) -> dict[str, Any]:
    """Where an input is: the option's field, or the attach file's JSON path."""
    return {"where": f"{spec.source}: {path}"} if spec.source else {"field": field_name}


def _check(spec: AttachSpec) -> list[str]:
    """BadInput for what cannot work; notes for what will not be observable."""
    notes = []
    roles = {i.role for i in spec.instances}
    for role in ("prefill", "decode"):
        if role not in roles:
            raise BadInput(f"the cluster has no {role} instance", **_located(spec, role, f"$.{role}"),
                           fix=f"give at least one {role} server's URL")
    for i in spec.instances:
        at = _located(spec, f"{i.role}_log", f"$.{i.role} ({i.name}).log")
        if i.log is None:
            notes.append(f"{i.name}: no log source; the checks that read its log will be reported as not "
                         "observable")
        elif i.log.path is not None and not i.log.path.is_file():
            raise BadInput(f"{i.name}'s log file {i.log.path} does not exist here", **at,
                           fix="give the file the server writes its log to, as seen from here, or "
                               "cmd:COMMAND that prints the log")
        elif i.log.command is not None:
            try:
                program = shlex.split(i.log.command)[0]
            except (ValueError, IndexError):
                raise BadInput(f"{i.name}'s log command {i.log.command!r} cannot be parsed", **at,
                               fix="quote it as a shell would") from None
            if "/" not in program and "=" not in program and shutil.which(program) is None:
                notes.append(f"{i.name}: {program!r} is not on PATH here; verify will report its log as "
                             "not observable until it is")
    if spec.store is None:
        notes.append("store: not visible here; store_entry_written will be reported as not observable")
    elif not spec.store.is_dir():
        raise BadInput(f"store directory {spec.store} is not visible here", **_located(spec, "store", "$.store"),
                       fix="give the store as mounted on this host, or leave it out (then the store check "
                           "is reported as not observable)")
    return notes


def attach_cluster(spec: AttachSpec) -> AttachResult:
    """Register the cluster of `spec` as cluster.json; starts nothing.

    Raises BadInput when the name is taken, an input is invalid, a log file or
    the store is missing here, or the served model name is neither given nor
    answered by the first prefill's /v1/models.
    """
    cdir = cluster_dir(spec.name)
    if (cdir / STATE_FILE).exists():
        try:
            existing = load_cluster(spec.name)
            how = "attached" if not existing.managed else "launched by kvctl"
            forget = "`kvctl detach` forgets it" if not existing.managed else "`kvctl down` stops it"
        except BadInput:
            how, forget = "with unreadable state", "`kvctl down` removes it"
        raise BadInput(f"cluster {spec.name!r} already exists ({how})", where=str(cdir),
                       fix=f"attach under another name, or {forget} first")
    notes = _check(spec)
    served, root = spec.served_model_name, None
    if served is None:
        first = next(i for i in spec.instances if i.role == "prefill")
        served, root = served_model_name(first.url)
    state = ClusterState(name=spec.name, runtime=ATTACHED_RUNTIME, model=spec.model or root or served,
                         served_model_name=served, store=str(spec.store) if spec.store else None,
                         created=utc_now(), managed=False, endpoint=spec.endpoint,
                         store_signed=bool(spec.store_keys))
    for i in spec.instances:
        log_path = ("" if i.log is None else str(i.log.path) if i.log.path is not None
                    else str(cdir / "logs" / f"{i.name}.log"))
        state.instances[i.name] = InstanceRecord(
            role=i.role, url=i.url, log_path=log_path, kv_transfer_config=i.kv_transfer_config, cwd="",
            runtime_fields={}, log_source=str(i.log) if i.log is not None else "")
    save_cluster(state)
    if spec.store_keys:
        save_store_keys(spec.name, spec.store_keys)
    log.info("attached cluster %r (%d instances) from %s", spec.name, len(spec.instances),
             spec.source or "options")
    return AttachResult(state, notes)


@dataclass
class DetachReport:
    name: str
    found: bool  # False: there was nothing to forget
    removed: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "found": self.found, "removed": self.removed}


def detach_cluster(name: str) -> DetachReport:
    """Forget attached cluster `name`: its state and captured logs; its servers keep running.

    Idempotent. Raises BadInput for a cluster kvctl launched (`down` is for
    those) or one whose state is unreadable.
    """
    cdir = cluster_dir(name)
    if not (cdir / STATE_FILE).exists():
        return DetachReport(name, found=False)
    state = load_cluster(name)
    if state.managed:
        raise BadInput(f"cluster {name!r} was launched by kvctl; detach only forgets clusters kvctl did not start",
                       where=str(cdir / STATE_FILE),
                       fix=f"stop it and remove its state with `kvctl down` (cluster {name!r})")
    shutil.rmtree(cdir)
    return DetachReport(name, found=True, removed=str(cdir))
