"""Cluster state: what is running, in `$KVCTL_HOME/clusters/<name>/cluster.json`.

    {"name": str, "runtime": "local"|"docker", "model": abs path,
     "served_model_name": str, "store": abs host path of the shared store dir,
     "created": ISO-8601 UTC,
     "endpoint": the router's URL (one OpenAI endpoint in front of P and D),
     "router": {"url", "pid", "start_ticks", "command", "log_path"},
     "lmcache": {NAME: {"serves": [instance names], "sharing", "url", "port", "http_port",
                        "metrics", "options", "pid", "start_ticks", "command", "log_path"}},
     "instances": {"prefill": {...}, "decode": {...}}}

`endpoint` and `router` are absent when the cluster was launched without its
router (`router: false` in the spec); `lmcache` when no instance names
LMCacheMPConnector (kvctl.cluster.lmcache: the LMCache servers kvctl runs for them). `"api_key_required": true` is written when
the cluster was launched with an API key: its servers and router then require
`Authorization: Bearer KEY` on /v1/* (/health stays open). The key itself is
never in cluster.json: it lives in the file `api_key` beside it (mode 0600,
`save_api_key`), where kvctl's own requests read it (`cluster_api_key`).
`"store_signed": true`: its servers sign the store's entries and serve only
signed ones (connectors.store.auth); the keys live in the file `store_key`
beside cluster.json (mode 0600, first signs), and reach the servers as
$KVCTL_STORE_KEY in their environment, never on a command line.

Each instance: `role`, `url`, `pid` (local) or `container_id` (docker) plus
runtime extras (`start_ticks`, `command`), `log_path`, `kv_transfer_config`
(dict, or null for a server without a connector), `cwd`. Other kvctl modules
(verify, inspect-store, scenarios) read these fields: they are a contract.
The cluster dir also holds the servers' cwd, their logs under `logs/`, and
the default store `store/`. The file is written atomically (temp + rename).

A cluster kvctl did not start (`kvctl attach`, kvctl.attach) adds to that:

    {"runtime": "attached", "managed": false,
     "endpoint": router URL (only when there is one),
     "store": null when the store is not visible from this host,
     "instances": {NAME: {"role": "prefill"|"decode", "url": ...,
                          "log_source": a file path | "cmd:COMMAND" | null,
                          "log_path": the file verify reads ("" without a source), ...}}}

Instances are keyed by name: `prefill` and `decode` for 1P1D (as launch
writes them), `prefill-0`, `decode-0`, ... for pools; `role` says which
pool. `managed` is written only when false. `down` refuses a cluster that is not managed; `kvctl detach`
forgets it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connectors.store.atomic import write_atomic
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home
from kvctl.runtime.attached import NAME as ATTACHED_RUNTIME  # the `runtime` of a cluster kvctl did not start

if TYPE_CHECKING:
    from connectors.store.auth import StoreKeys

DEFAULT_NAME = "default"
STATE_FILE = "cluster.json"
COMMAND_PREFIX = "cmd:"  # a log source that is a command whose output is the log
API_KEY_FILE = "api_key"  # the cluster's API key, mode 0600, beside cluster.json
API_KEY_ENV = "KVCTL_API_KEY"  # the key for a launch, and for clusters without the file (attached)
STORE_KEY_FILE = "store_key"  # the cluster's store keys (first signs), mode 0600, beside cluster.json
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class LogSource:
    """Where an instance's log comes from: a file on this host, or a command's output.

    Written in cluster.json as the path, or as `cmd:COMMAND` (run with a shell,
    e.g. `cmd:kubectl logs -f deploy/decode-0 -n serving`).
    """

    path: Path | None = None
    command: str | None = None

    @classmethod
    def parse(cls, text: str, field: str = "log") -> LogSource:
        """A source as people write it. Raises BadInput (`field`) for an empty one."""
        text = (text or "").strip()
        if text.startswith(COMMAND_PREFIX):
            command = text[len(COMMAND_PREFIX):].strip()
            if not command:
                raise BadInput(f"empty log command {text!r}", field=field,
                               fix="write cmd: and the command whose output is the log, e.g. "
                                   "'cmd:kubectl logs -f deploy/decode-0'")
            return cls(command=command)
        if not text:
            raise BadInput("empty log source", field=field,
                           fix="give the log file's path, or cmd:COMMAND whose output is the log")
        return cls(path=Path(text).expanduser().absolute())

    def __str__(self) -> str:
        return f"{COMMAND_PREFIX}{self.command}" if self.command is not None else str(self.path)


@dataclass
class InstanceRecord:
    role: str
    url: str
    log_path: str
    kv_transfer_config: dict | None
    cwd: str
    runtime_fields: dict[str, Any]  # `pid`, `start_ticks`, `command` / `container_id`
    # Attached instances only: the source as given (a path or `cmd:...`); "" when the
    # log is not observable from here. None for launched ones (their log is log_path).
    log_source: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"role": self.role, "url": self.url, **self.runtime_fields,
                "log_path": self.log_path, "kv_transfer_config": self.kv_transfer_config,
                "cwd": self.cwd}
        if self.log_source is not None:
            data["log_source"] = self.log_source or None
        return data

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InstanceRecord:
        known = {"role", "url", "log_path", "kv_transfer_config", "cwd", "log_source"}
        source = d.get("log_source", ...)
        return cls(role=d["role"], url=d["url"], log_path=d.get("log_path") or "",
                   kv_transfer_config=d.get("kv_transfer_config"), cwd=d.get("cwd") or "",
                   runtime_fields={k: v for k, v in d.items() if k not in known},
                   log_source=None if source is ... else (source or ""))

    def source(self) -> LogSource | None:
        """Where this instance's log comes from; None when it is not observable from here."""
        if self.log_source is None:
            return LogSource(path=Path(self.log_path)) if self.log_path else None
        return LogSource.parse(self.log_source) if self.log_source else None


@dataclass
class ClusterState:
    name: str
    runtime: str
    model: str
    served_model_name: str
    store: str | None  # None: an attached cluster whose store is not visible from this host
    created: str
    instances: dict[str, InstanceRecord] = field(default_factory=dict)  # keyed by instance name
    managed: bool = True  # False: kvctl did not start it (attached); `down` refuses it
    endpoint: str | None = None  # the router URL in front of the instances, if any
    router: dict[str, Any] | None = None  # the router process kvctl started (url, pid, log_path, ...)
    lmcache: dict[str, dict[str, Any]] = field(default_factory=dict)  # LMCache servers kvctl started, by name
    api_key_required: bool = False  # launched with an API key (the key: the `api_key` file)
    store_signed: bool = False  # its servers sign and check store entries (the keys: the `store_key` file)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "runtime": self.runtime, "model": self.model,
                                "served_model_name": self.served_model_name}
        data["store"] = self.store  # null: an attached cluster's store is not visible here
        data["created"] = self.created
        if not self.managed:
            data["managed"] = False
        if self.endpoint is not None:
            data["endpoint"] = self.endpoint
        if self.router is not None:
            data["router"] = self.router
        if self.lmcache:
            data["lmcache"] = {n: dict(r) for n, r in self.lmcache.items()}
        if self.api_key_required:
            data["api_key_required"] = True
        if self.store_signed:
            data["store_signed"] = True
        data["instances"] = {r: i.to_json() for r, i in self.instances.items()}
        return data

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClusterState:
        managed = d.get("managed", True)
        if not isinstance(managed, bool):
            raise TypeError(f"managed must be true or false, got {managed!r}")
        return cls(name=d["name"], runtime=d["runtime"], model=d["model"],
                   served_model_name=d["served_model_name"],
                   store=d["store"] if managed else d.get("store"),
                   created=d["created"],
                   instances={r: InstanceRecord.from_json(i) for r, i in d["instances"].items()},
                   managed=managed, endpoint=d.get("endpoint"), router=d.get("router"),
                   lmcache=dict(d.get("lmcache") or {}),
                   api_key_required=d.get("api_key_required") is True,
                   store_signed=d.get("store_signed") is True)

    def by_role(self, role: str) -> dict[str, InstanceRecord]:
        """This cluster's instances of `role` (prefill or decode), by name, in name order."""
        return {n: i for n, i in sorted(self.instances.items()) if i.role == role}


# --- where state lives ---

def validate_cluster_name(name: str) -> str:
    """`name`, checked. Raises BadInput (field `name`) for one unfit for a directory."""
    if not _NAME_RE.match(name or ""):
        raise BadInput(f"invalid cluster name {name!r}", field="name",
                       fix="use letters, digits, '.', '_' or '-' (at most 63, not starting with '.' or '-')")
    return name


def clusters_root() -> Path:
    return kvctl_home() / "clusters"


def cluster_dir(name: str) -> Path:
    return clusters_root() / validate_cluster_name(name)


def list_clusters() -> list[str]:
    """Names of clusters that have state (a cluster.json), sorted."""
    root = clusters_root()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{STATE_FILE}"))


def save_cluster(state: ClusterState) -> Path:
    """Write cluster.json atomically (temp file + rename): readers never see half a file."""
    path = cluster_dir(state.name) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(state.to_json(), indent=2) + "\n")


def remove_state(name: str) -> None:
    """Remove cluster.json, the API key and the store key files (the logs and the store stay)."""
    (cluster_dir(name) / STATE_FILE).unlink(missing_ok=True)
    (cluster_dir(name) / API_KEY_FILE).unlink(missing_ok=True)
    (cluster_dir(name) / STORE_KEY_FILE).unlink(missing_ok=True)


# --- the API key: a file only this user reads, never in cluster.json or a command line ---

def check_api_key(key: str, field: str = "api_key") -> str:
    """`key`, checked. Raises BadInput (`field`) for an empty key or one an HTTP header
    cannot carry (whitespace, control characters)."""
    if not key or not key.strip():
        raise BadInput("the API key is empty", field=field,
                       fix=f"give a non-empty key (or unset {API_KEY_ENV} to launch without one)")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise BadInput("the API key holds whitespace or control characters, which an "
                       "`Authorization: Bearer KEY` header cannot carry", field=field,
                       fix="use a key of printable characters without spaces, e.g. `openssl rand -hex 16`")
    return key


def save_api_key(name: str, key: str) -> Path:
    """Write cluster `name`'s API key to its `api_key` file, created with mode 0600 (never
    readable by others, even for a moment), atomically (temp file + rename)."""
    return _save_secret(cluster_dir(name) / API_KEY_FILE, key + "\n")


def _save_secret(path: Path, text: str) -> Path:
    """Write `text` to `path` with mode 0600 from its creation on, atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, text, mode=0o600)


# --- the store keys: the same kind of file; servers get them as $KVCTL_STORE_KEY ---

def save_store_keys(name: str, secrets: Sequence[str]) -> Path:
    """Write cluster `name`'s store keys (first signs) to its `store_key` file, mode 0600."""
    return _save_secret(cluster_dir(name) / STORE_KEY_FILE, "".join(f"{s}\n" for s in secrets))


def check_store_keys(secrets: Sequence[str], field: str = "store_key") -> tuple[str, ...]:
    """The store keys, checked: each non-empty, printable, without whitespace or commas (the
    servers get them comma-separated). Raises BadInput (`field`)."""
    for secret in secrets:
        if not secret or any(c.isspace() or not c.isprintable() or c == "," for c in secret):
            raise BadInput("a store key is empty or holds whitespace, a comma or control characters",
                           field=field, fix="use keys of printable characters without spaces or commas, "
                                            "one per line in the key file (e.g. `openssl rand -hex 32`)")
    return tuple(secrets)


def launch_store_keys(enabled: bool, key_file: Path | None = None,
                      env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The store keys a launch gives its servers: those in `key_file` (default
    $KVCTL_STORE_KEY_FILE), else a new random key; () when not `enabled`.
    Raises BadInput (field store_key_file) for a file that cannot be read or holds no key."""
    from connectors.store import auth

    if not enabled:
        return ()
    env = os.environ if env is None else env
    path = key_file or env.get(auth.KEY_FILE_ENV)
    if not path:
        return (auth.generate_secret(),)
    try:
        secrets = auth.parse_key_file(Path(path).read_text())
    except OSError as e:
        raise BadInput(f"cannot read the store key file {path}: {e.strerror or e}", field="store_key_file",
                       fix="name a readable file of store keys, one per line (the first signs)") from None
    if not secrets:
        raise BadInput(f"the store key file {path} holds no key", field="store_key_file",
                       fix="put a key on its first line, e.g. `openssl rand -hex 32 > FILE`")
    return check_store_keys(secrets, "store_key_file")


def cluster_store_keys(name: str) -> "StoreKeys | None":
    """The store keys kvctl checks cluster `name`'s entries with: its `store_key` file (launched
    or attached with keys), else $KVCTL_STORE_KEY_FILE / $KVCTL_STORE_KEY, else None.
    Raises BadInput when a key file cannot be read."""
    from connectors.store import auth

    try:
        path = cluster_dir(name) / STORE_KEY_FILE
    except BadInput:
        path = None
    try:
        if path is not None and path.is_file():
            return auth.read_key_file(path)
        return auth.keys_from()
    except auth.StoreKeyError as e:
        raise BadInput(str(e), field="store_key",
                       fix=f"point ${auth.KEY_FILE_ENV} at a readable file of store keys, one per line") from None


def load_api_key(name: str) -> str | None:
    """Cluster `name`'s API key from its `api_key` file; None without one."""
    try:
        key = (cluster_dir(name) / API_KEY_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return key or None


def cluster_api_key(name: str) -> str | None:
    """The key kvctl sends (`Authorization: Bearer KEY`) to cluster `name`: its `api_key`
    file (a cluster launched with a key), else $KVCTL_API_KEY (e.g. an attached cluster
    whose servers require one), else None. A name unfit for a directory has no file."""
    try:
        key = load_api_key(name)
    except BadInput:
        key = None
    return key or os.environ.get(API_KEY_ENV) or None


def _unknown_cluster(name: str, where: Path) -> BadInput:
    existing = list_clusters()
    fix = (f"name one of: {', '.join(existing)}" if existing
           else f"launch a cluster named {name!r} first (`kvctl launch 1p1d`)")
    return BadInput(f"no cluster named {name!r}", where=str(where), fix=fix)


def load_cluster(name: str) -> ClusterState:
    """The state of cluster `name`.

    Raises BadInput naming the cluster and the existing ones when there is no
    such cluster or its cluster.json is unreadable.
    """
    path = cluster_dir(name) / STATE_FILE
    try:
        data = json.loads(path.read_text())
        return ClusterState.from_json(data)
    except FileNotFoundError:
        raise _unknown_cluster(name, path) from None
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"the state of cluster {name!r} is unreadable: {e}", where=str(path),
                       fix=f"tear cluster {name!r} down with `kvctl down` (it removes the state)") from None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
