"""Validation of `--kv-transfer-config`: the one source of truth.

The connectors call it when a vLLM server starts (a bad config stops the
server with every problem listed) and `kvctl validate` calls it without
starting anything. It imports neither torch, vLLM nor kvctl.

Every problem names a JSON path into the config, what is wrong and the fix::

    $.kv_connector_extra_config.connectors[1].kv_role: 'kv_consumr' is not a
    role (fix: use one of kv_producer, kv_consumer, kv_both)

Rules beyond vLLM's own `KVTransferConfig`:

- `kv_role` is required (vLLM refuses a connector without one, too).
- FSConnector's extra config is `FSConnectorSettings` (unknown keys refused).
- MultiConnectorV0 needs a non-empty `connectors` list of full
  KVTransferConfig dicts. A child may not be MultiConnectorV0 itself, and its
  role must be one the parent ever triggers: a `kv_producer` parent only sends,
  so a `kv_consumer` child would never run (and the reverse).
- At most one child is marked `"transfer": true`. The transfer child is the
  one that carries KV from prefill to decode; the multi connector hands it the
  prompt as it was before any other child rebuilt the input, and kvctl looks
  for the P->D store there. Two would make "the" transfer store ambiguous; an
  extra copy of the KV is an offload child (`transfer` false).

Which child sends, receives, carries the transfer or stores where is
`connectors.config.topology`'s rule; this module only checks configs.

Engines: every check takes the engine the server runs (`v0`, the default:
vLLM 0.9.x with VLLM_USE_V1=0; `v1`: vLLM 0.11+). V1 configs differ: V1's
KVTransferConfig fields (`kv_connector_module_path` loads a connector from a
module, `kv_load_failure_policy`, no `kv_rank`/`kv_ip`...), V1's connector
names, and vLLM's own `MultiConnector`, whose `connectors` list holds full
configs, each with its own `kv_role` (loads from the first child that has the
tokens, saves to all). `required_engine` says which engine a config needs.

MultiConnector (V1) follows the same child rules, except that the parent's
role gates nothing (V1 runs each child by its own role, so a child's role is
never "unreachable"); "transfer": true still marks the FS child kvctl reads.
Warnings: a child that receives before the FSConnector transfer child on D
(V1 would load from it first), an ExampleConnector writing into an
FSConnector child's store.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors.config import topology
from connectors.config.names import ENGINES
from connectors.config.topology import (FS_CONNECTOR, LMCACHE_MP_CONNECTOR, LMCACHE_V1_CONNECTOR, MULTI_CONNECTOR,
                                        ROLE_BLIND_V1, ROLES, V1_MULTI_CONNECTOR)

# Names vLLM 0.9.2's KVConnectorFactory can build as V0 connectors, plus ours
# (registered by connectors.plugin).
KNOWN_V0_CONNECTORS = (
    "PyNcclConnector", "MooncakeConnector", "LMCacheConnector", "MooncakeStoreConnector",
    FS_CONNECTOR, MULTI_CONNECTOR,
)
# A user's own V0 connectors, registered by connectors.plugin from this variable:
# "Name=module:Class;Name2=module2:Class2".
EXTRA_CONNECTORS_ENV = "KVCTL_EXTRA_CONNECTORS"


def parse_extra_connectors(value: str) -> dict[str, tuple[str, str]]:
    """`Name=module:Class;...` -> {Name: (module, Class)}. Raises ValueError naming the bad item."""
    found = {}
    for item in filter(None, (part.strip() for part in value.split(";"))):
        name, eq, target = item.partition("=")
        module, colon, cls = target.partition(":")
        if not (eq and colon and name.strip() and module.strip() and cls.strip()):
            raise ValueError(f"{EXTRA_CONNECTORS_ENV}: {item!r} is not Name=module:Class")
        found[name.strip()] = (module.strip(), cls.strip())
    return found


def registered_v0_connectors(env: Mapping[str, str]) -> tuple[str, ...]:
    """The names a server started with `env` accepts: vLLM's, ours and the user's extras."""
    return KNOWN_V0_CONNECTORS + tuple(parse_extra_connectors(env.get(EXTRA_CONNECTORS_ENV, "")))


# Registered in the same factory but V1-only: named so the error can say so.
KNOWN_V1_CONNECTORS = (
    "SharedStorageConnector", "P2pNcclConnector", "LMCacheConnectorV1", "NixlConnector",
    V1_MULTI_CONNECTOR,
)
# What vLLM 0.32's (V1-only) factory registers (ExampleConnector was SharedStorageConnector).
VLLM_V1_CONNECTORS = (
    "ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
    "NixlConnector", "NixlPullConnector", "NixlPushConnector", V1_MULTI_CONNECTOR, "HiSparseConnector",
    "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector",
    "MooncakeStoreConnector", "FlexKVConnectorV1", "SimpleCPUOffloadConnector", "HF3FSKVConnector",
)
V1_ONLY_CONNECTORS = tuple(dict.fromkeys(
    KNOWN_V1_CONNECTORS + tuple(n for n in VLLM_V1_CONNECTORS if n not in KNOWN_V0_CONNECTORS)))
# Names only V0 can build (MooncakeConnector and MooncakeStoreConnector exist in both).
V0_ONLY_CONNECTORS = ("PyNcclConnector", "LMCacheConnector", MULTI_CONNECTOR)

# vLLM 0.9.2 KVTransferConfig fields -> the JSON types each accepts.
KV_TRANSFER_FIELDS: dict[str, tuple[type, ...]] = {
    "kv_connector": (str,),
    "engine_id": (str,),
    "kv_buffer_device": (str,),
    "kv_buffer_size": (int, float),
    "kv_role": (str,),
    "kv_rank": (int,),
    "kv_parallel_size": (int,),
    "kv_ip": (str,),
    "kv_port": (int,),
    "kv_connector_extra_config": (dict,),
    "kv_connector_module_path": (str,),
}
MULTI_EXTRA_KEYS = ("connectors",)
# vLLM 0.32 KVTransferConfig fields (V1) -> the JSON types each accepts.
KV_TRANSFER_FIELDS_V1: dict[str, tuple[type, ...]] = {
    "kv_connector": (str,),
    "engine_id": (str,),
    "kv_buffer_device": (str,),
    "kv_role": (str,),
    "kv_port": (int,),
    "kv_connector_extra_config": (dict,),
    "kv_connector_module_path": (str,),
    "enable_permute_local_kv": (bool,),
    "kv_load_failure_policy": (str,),
}

# LMCacheMPConnector's `kv_connector_extra_config` (LMCache 0.5.6: lmcache_mp_connector.py and
# vllm_multi_process_adapter.py's ExtraConfigDefault) -> the JSON types each accepts. LMCache
# ignores any other key, so a misspelt one silently falls back to its default (the port: 5555).
LMCACHE_MP_EXTRA: dict[str, tuple[type, ...]] = {
    "lmcache.mp.host": (str,),  # "tcp://127.0.0.1": the server's ZMQ address, scheme included
    "lmcache.mp.port": (int,),
    "lmcache.mp.server_urls": (str, list),  # several servers; wins over host/port
    "lmcache.mp.mq_timeout": (int, float),  # seconds for blocking requests (default 300)
    "lmcache.mp.heartbeat_interval": (int, float),
    "lmcache.mp.nonblocking_lookup_status": (bool,),
    "lmcache.mp.mp_transfer_mode": (str,),
    "lmcache.mp.isolated_ipc": (bool,),
    "lmcache.mp.use_vmm_api": (bool,),
    "lmcache.mp.hash_algorithm": (str,),
    "lmcache.mp.save_decode_cache": (bool,),
    "lmcache.mp.eager_prefetch": (bool,),
    "lmcache.mp.lazy_offload": (bool,),
    "lmcache.mp.lazy_offload_policy": (str,),
    "lmcache.mp.lazy_offload_select_count": (int,),
    "lmcache.mp.lazy_offload_threshold": (int, float),
    "lmcache.mp.transfer_intermediate_tensors": (bool,),
    "lmcache.mp.autostart": (bool,),
    "lmcache.mp.autostart.server_args": (str, list),
    "lmcache.mp.autostart.wait_timeout": (int, float),
}
LMCACHE_TRANSFER_MODES = ("auto", "engine_driven", "lmcache_driven")  # auto: engine_driven on CPU
# Why the in-process connector is refused on CPU, and what to run instead (validate, launch).
LMCACHE_V1_ON_CPU = ("LMCacheConnectorV1 has no CPU path in LMCache 0.5.6: on a CPU-only host it logs "
                     "`No supported cpu connector found`, falls back to recomputing every prompt and "
                     "never hits, while the server looks healthy")
LMCACHE_V1_ON_CPU_FIX = ('use "LMCacheMPConnector" (LMCache\'s multi-process mode; kvctl starts its '
                         '`lmcache server` beside the instance), or run on a GPU')

Severity = Literal["error", "warning"]


@dataclass
class ConfigProblem:
    """One thing wrong with a config: where (JSON path), what, and the fix."""

    path: str
    message: str
    fix: str
    severity: Severity = "error"  # warnings never stop a server

    def __str__(self) -> str:
        tag = "warning: " if self.severity == "warning" else ""
        return f"{self.path}: {tag}{self.message} (fix: {self.fix})"


class ConfigError(ValueError):
    """A config with errors; `.problems` holds every one of them."""

    def __init__(self, problems: list[ConfigProblem], what: str = "invalid kv-transfer-config"):
        self.problems = problems
        errors = [p for p in problems if p.severity == "error"]
        lines = [f"{what}: {len(errors)} problem{'s' if len(errors) != 1 else ''}"]
        lines += [f"  {p}" for p in problems]
        super().__init__("\n".join(lines))


class FSConnectorSettings(BaseModel):
    """FSConnector's `kv_connector_extra_config`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    fs_storage_path: str = Field(min_length=1)
    """Store directory; P's and D's must be the same directory (a shared mount
    across hosts). A relative path is relative to the server's working dir."""
    transfer: bool = False
    """Marks the MultiConnectorV0 child that moves KV from P to D."""
    fsync: bool = True
    """fsync each entry before publishing it (durable across power loss)."""
    model_id: str | None = Field(default=None, min_length=1)
    """Names the weights in store keys; default: their identity (HF snapshot commit or content
    fingerprint, connectors.store.model_identity). The model dtype and other serving settings
    that change KV are added either way."""
    max_bytes: int | None = Field(default=None, gt=0)
    """Bound on the store's size in bytes; least recently used entries go first."""
    ttl_seconds: float | None = Field(default=None, gt=0)
    """Entries older than this are evicted."""
    store_key_file: str | None = Field(default=None, min_length=1)
    """File of store keys (one per line, the first signs): entries are signed and only signed
    ones are served (connectors.store.auth). Default: $KVCTL_STORE_KEY_FILE, then
    $KVCTL_STORE_KEY, else an unkeyed store. Never the key itself: the config is on a command line."""
    store_timeout_ms: int = Field(default=2000, gt=0)
    """Deadline of every store call the engine makes (V1: lookup, load, save; V0: see
    connectors.v0.fs_connector). Past it D recomputes the prompt and P drops the save,
    both logged; other requests are served meanwhile."""


# Fix hints for FSConnectorSettings fields, used when pydantic rejects them.
_FS_FIX = {
    "fs_storage_path": 'set "fs_storage_path" to the store directory P and D share, e.g. "/mnt/kv-store"',
    "transfer": "use true or false (JSON booleans, unquoted)",
    "fsync": "use true or false (JSON booleans, unquoted)",
    "model_id": "use a non-empty string, or leave it out to key on the served weights' identity",
    "max_bytes": "use a positive whole number of bytes, e.g. 10000000000 for 10 GB, or leave it out",
    "ttl_seconds": "use a positive number of seconds, or leave it out",
    "store_key_file": "use the path of a file holding the store key (mode 0600), or leave it out",
    "store_timeout_ms": "use a positive whole number of milliseconds, e.g. 2000, or leave it out (default 2000)",
}


def json_path(prefix: str, *parts: str | int) -> str:
    """Extend a JSON path: keys as `.key` (or `["odd key"]`), indices as `[i]`."""
    path = prefix
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            path += f".{part}"
        else:
            path += f"[{part!r}]"
    return path


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The closest choice to a mistyped word (a prefix counts), or None."""
    choices = list(choices)
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if matches:
        return matches[0]
    prefixed = [c for c in choices if len(word) >= 3 and c.startswith(word)]
    return prefixed[0] if len(prefixed) == 1 else None


def _unknown_key_fix(key: str, known: Iterable[str]) -> str:
    known = list(known)
    guess = did_you_mean(key, known)
    listing = ", ".join(known)
    if guess:
        return f"did you mean {guess!r}?"
    return f"remove it; known keys: {listing}"


_JSON_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
                    int: "an integer", float: "a number", type(None): "null"}


def _type_name(value: object) -> str:
    """The JSON type of a parsed value, with its article: 'an object'."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pydantic_problems(err: ValidationError, prefix: str,
                      known_keys: Iterable[str] | Callable[[tuple], Iterable[str]] = (),
                      fixes: dict[str, str] | None = None) -> list[ConfigProblem]:
    """Map each pydantic error to a ConfigProblem with a JSON path and a fix.

    `known_keys`: the keys allowed where an unknown key was found (or a
    function from the parent's location to them), for did-you-mean.
    `fixes` maps a top-level field name to the fix shown for any error in it;
    a dotted path ("prefill.engine") gives a nested field its own fix.
    """
    fixes = fixes or {}
    problems = []
    for e in err.errors(include_url=False):
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("<"))]
        path = json_path(prefix, *loc)
        key = str(loc[-1]) if loc else ""
        field = str(loc[0]) if loc else ""
        kind = e["type"]
        if kind == "extra_forbidden":
            known = known_keys(tuple(loc[:-1])) if callable(known_keys) else known_keys
            problems.append(ConfigProblem(path, f"unknown key {key!r}", _unknown_key_fix(key, known)))
            continue
        if kind == "missing":
            message = f"required key {key!r} is missing"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            message = f"must be an object, got {_type_name(e['input'])}"
        elif kind == "string_too_short" and e.get("ctx", {}).get("min_length") == 1:
            message = "must not be empty"
        elif kind == "value_error":  # our own validators already name the value
            message = e["msg"].removeprefix("Value error, ")
        else:
            msg = re.sub(r"^(Input|String|List|Dictionary) should", "must", e["msg"])
            message = f"{msg}, got {_shown(e['input'])}"
        fix = fixes.get(".".join(str(p) for p in loc)) or fixes.get(field, "see the documented schema")
        problems.append(ConfigProblem(path, message, fix))
    return problems


def parse_fs_settings(extra: dict | None, path_prefix: str = "$.kv_connector_extra_config") -> FSConnectorSettings:
    """FSConnector's settings from its extra config. Raises ConfigError."""
    problems = _check_fs_extra(extra, path_prefix)
    if any(p.severity == "error" for p in problems):
        raise ConfigError(problems, what="invalid FSConnector kv_connector_extra_config")
    return FSConnectorSettings.model_validate(extra)


def _check_fs_extra(extra: object, prefix: str) -> list[ConfigProblem]:
    if extra is None or extra == {}:
        return [ConfigProblem(json_path(prefix, "fs_storage_path"),
                              "required key 'fs_storage_path' is missing: FSConnector needs a store directory",
                              _FS_FIX["fs_storage_path"])]
    if not isinstance(extra, dict):
        return [ConfigProblem(prefix, f"must be an object, got {_type_name(extra)}",
                              'use {"fs_storage_path": "<dir shared by P and D>"}')]
    try:
        FSConnectorSettings.model_validate(extra)
    except ValidationError as e:
        return pydantic_problems(e, prefix, FSConnectorSettings.model_fields, _FS_FIX)
    return []


def check_kv_transfer_config(cfg: object, registered: Iterable[str] | None = None,
                             engine: str = "v0", device: str | None = None) -> list[ConfigProblem]:
    """Every problem in a whole `--kv-transfer-config` dict ([] when valid), for `engine`.

    `registered`: connector names the V0 factory knows (default
    KNOWN_V0_CONNECTORS; on v1, V1's names and FSConnector are added).
    `device`: where the server runs, "cpu" or "gpu" (None: unknown); anything but
    "gpu" warns about LMCacheConnectorV1, which cannot serve on CPU. Never
    raises (an unknown engine is a problem at `$`).
    """
    if engine not in ENGINES:
        return [ConfigProblem("$", f"unknown engine {engine!r}", f"use one of: {', '.join(ENGINES)}")]
    names = tuple(sorted(registered)) if registered is not None else KNOWN_V0_CONNECTORS
    if engine == "v1":
        names = tuple(dict.fromkeys(tuple(n for n in names if n not in V0_ONLY_CONNECTORS)
                                    + VLLM_V1_CONNECTORS + ("SharedStorageConnector", "P2pNcclConnector")))
    return _check_config(cfg, "$", names, parent_role=None, engine=engine, device=device)


def validate_kv_transfer_config(cfg: object, registered: Iterable[str] | None = None,
                                engine: str = "v0", device: str | None = None) -> None:
    """Raise ConfigError listing every error (warnings alone pass)."""
    problems = check_kv_transfer_config(cfg, registered, engine, device)
    if any(p.severity == "error" for p in problems):
        raise ConfigError(problems)


def required_engine(cfg: object) -> str | None:
    """The engine a config needs: "v0", "v1", or None when either runs it (FSConnector alone).

    Reads names only (V0-only or V1-only connectors, `kv_connector_module_path`,
    children of a multi connector); never raises.
    """
    if not isinstance(cfg, dict):
        return None
    name = cfg.get("kv_connector")
    if name in V0_ONLY_CONNECTORS:
        return "v0"
    if name in V1_ONLY_CONNECTORS or cfg.get("kv_connector_module_path") is not None:
        return "v1"
    return None


def _check_config(cfg: object, prefix: str, registered: tuple[str, ...],
                  parent_role: str | None, engine: str = "v0", device: str | None = None) -> list[ConfigProblem]:
    if not isinstance(cfg, dict):
        return [ConfigProblem(prefix, f"must be an object, got {_type_name(cfg)}",
                              'use {"kv_connector": "<name>", "kv_role": "<role>", ...}')]
    problems: list[ConfigProblem] = []
    name = cfg.get("kv_connector")
    multi = V1_MULTI_CONNECTOR if engine == "v1" else MULTI_CONNECTOR
    fields = KV_TRANSFER_FIELDS_V1 if engine == "v1" else KV_TRANSFER_FIELDS
    # Our connectors' (and LMCacheMPConnector's) extra config gets its own, more specific check below.
    own_extra = name in (FS_CONNECTOR, multi, LMCACHE_MP_CONNECTOR)
    for key, value in cfg.items():
        if key == "kv_connector_extra_config" and own_extra:
            continue
        if key not in fields:
            where = "vLLM V1 refuses it" if engine == "v1" else "vLLM refuses it"
            problems.append(ConfigProblem(json_path(prefix, key), f"unknown key {key!r} ({where})",
                                          _unknown_key_fix(key, fields)))
        elif value is not None and not _is_type(value, fields[key]) and key not in (
                "kv_connector", "kv_role"):
            types = fields[key]
            want = "a number" if float in types else _JSON_TYPE_NAMES[types[0]]
            problems.append(ConfigProblem(json_path(prefix, key), f"must be {want}, got {_shown(value)}",
                                          f"give {key} as {want}" + (", without quotes" if str not in types else "")))
    module_path = cfg.get("kv_connector_module_path")
    if module_path is not None and engine == "v0":
        problems.append(ConfigProblem(json_path(prefix, "kv_connector_module_path"),
                                      "ignored by vLLM V0 (V1-only); V0 finds connectors by name only",
                                      "remove it; our connectors register through the vllm.general_plugins "
                                      "entry point", "warning"))
    policy = cfg.get("kv_load_failure_policy")
    if engine == "v1" and isinstance(policy, str) and policy not in ("recompute", "fail"):
        problems.append(ConfigProblem(json_path(prefix, "kv_load_failure_policy"),
                                      f"{_shown(policy)} is not a policy", "use recompute or fail"))
    if engine == "v1" and isinstance(module_path, str) and isinstance(name, str):
        pass  # vLLM imports the class named `name` from that module: any name is fine
    else:
        problems += _check_name(name, prefix, registered, nested=parent_role is not None, engine=engine)
    role = cfg.get("kv_role")
    # V1's MultiConnector runs every child by its own role (connectors.config.topology)
    problems += _check_role(role, prefix, parent_role if engine == "v0" else None)

    extra_path = json_path(prefix, "kv_connector_extra_config")
    extra = cfg.get("kv_connector_extra_config")
    if name == FS_CONNECTOR:
        problems += _check_fs_extra(extra, extra_path)
    elif name == LMCACHE_MP_CONNECTOR:
        problems += _check_lmcache_mp_extra(extra, extra_path)
    elif name == multi and parent_role is None:
        problems += _check_multi(cfg, extra_path, registered, engine, device)
    if name == LMCACHE_V1_CONNECTOR and engine == "v1" and device != "gpu":
        problems.append(ConfigProblem(json_path(prefix, "kv_connector"), LMCACHE_V1_ON_CPU + (
            "" if device == "cpu" else " (if this server has no GPU)"), LMCACHE_V1_ON_CPU_FIX, "warning"))
    return problems


def _check_lmcache_mp_extra(extra: object, prefix: str) -> list[ConfigProblem]:
    """LMCacheMPConnector's extra config: known `lmcache.mp.*` keys of the right JSON types."""
    if extra is None:
        return []  # LMCache's defaults (tcp://localhost:5555); kvctl fills in its server's address
    if not isinstance(extra, dict):
        return [ConfigProblem(prefix, f"must be an object, got {_type_name(extra)}",
                              'use {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}')]
    problems = []
    for key, value in extra.items():
        path = json_path(prefix, key)
        if key not in LMCACHE_MP_EXTRA:
            problems.append(ConfigProblem(path, f"unknown key {key!r}: LMCache ignores it, so its setting "
                                                "silently keeps the default", _unknown_key_fix(key, LMCACHE_MP_EXTRA)))
        elif not _is_type(value, LMCACHE_MP_EXTRA[key]):
            types = LMCACHE_MP_EXTRA[key]
            want = " or ".join(_JSON_TYPE_NAMES[t] for t in types if t is not float or int not in types)
            want = "a number" if float in types else want
            problems.append(ConfigProblem(path, f"must be {want}, got {_shown(value)}",
                                          f"give {key} as {want}" + (", without quotes" if str not in types else "")))
    host, port = extra.get("lmcache.mp.host"), extra.get("lmcache.mp.port")
    if isinstance(host, str) and "://" not in host:
        problems.append(ConfigProblem(json_path(prefix, "lmcache.mp.host"),
                                      f"{_shown(host)} has no transport scheme",
                                      f'write it as "tcp://{host}" (LMCache\'s server speaks ZMQ over TCP)'))
    if isinstance(port, int) and not isinstance(port, bool) and not 0 < port < 65536:
        problems.append(ConfigProblem(json_path(prefix, "lmcache.mp.port"), f"port {port} is out of range",
                                      "use 1024-65535, or leave it out: kvctl gives its server a free port"))
    mode = extra.get("lmcache.mp.mp_transfer_mode")
    if isinstance(mode, str) and mode not in LMCACHE_TRANSFER_MODES:
        problems.append(ConfigProblem(json_path(prefix, "lmcache.mp.mp_transfer_mode"),
                                      f"{_shown(mode)} is not a transfer mode",
                                      f"use one of {', '.join(LMCACHE_TRANSFER_MODES)} (auto: engine_driven on CPU)"))
    return problems


def _is_type(value: object, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # JSON true is not a number
        return bool in types
    return isinstance(value, types)


def _check_name(name: object, prefix: str, registered: tuple[str, ...], nested: bool,
                engine: str = "v0") -> list[ConfigProblem]:
    """The connector's name, against what `engine` can build (same rules for both, its own words)."""
    path = json_path(prefix, "kv_connector")
    v1 = engine == "v1"
    # vLLM's factory registry also holds V1-only names; V0 cannot build those.
    listing = ", ".join(registered if v1 else (n for n in registered if n not in V1_ONLY_CONNECTORS))
    registered_text = f"registered {engine.upper()} connectors: {listing}"
    multi = V1_MULTI_CONNECTOR if v1 else MULTI_CONNECTOR
    if name is None:
        return [ConfigProblem(path, "required key 'kv_connector' is missing", f"name the connector; {registered_text}")]
    if not isinstance(name, str):
        return [ConfigProblem(path, f"must be a string, got {_shown(name)}", f"use a connector name; {registered_text}")]
    if nested and name == multi:
        return [ConfigProblem(path, f"a {multi} child cannot itself be {multi}",
                              "list its connectors directly in the parent's connectors")]
    if v1 and name in V0_ONLY_CONNECTORS:
        fix = "use vLLM's MultiConnector" if name == MULTI_CONNECTOR else f"use a V1 connector: {listing}"
        return [ConfigProblem(path, f"{name!r} is a vLLM V0 connector; V1 cannot build it",
                              f"{fix}, or run the server on engine v0")]
    if not v1 and name in V1_ONLY_CONNECTORS:
        return [ConfigProblem(path, f"{name!r} is a vLLM V1 connector; V0 (VLLM_USE_V1=0) cannot build it",
                              f"use a V0 connector: {listing}, or run the server on engine v1")]
    if name in registered:
        return []
    guess = did_you_mean(name, registered)
    hint = f"did you mean {guess!r}? " if guess else ""
    also = " (or load it with kv_connector_module_path)" if v1 else ""
    return [ConfigProblem(path, f"unknown connector {name!r}", f"{hint}{registered_text}{also}")]


def _check_role(role: object, prefix: str, parent_role: str | None) -> list[ConfigProblem]:
    path = json_path(prefix, "kv_role")
    listing = ", ".join(ROLES)
    if role is None:
        return [ConfigProblem(path, "required key 'kv_role' is missing",
                              f"add \"kv_role\": one of {listing}")]
    if role not in ROLES:
        guess = did_you_mean(str(role), ROLES)
        hint = f"did you mean {guess!r}? " if guess else ""
        return [ConfigProblem(path, f"{_shown(role)} is not a role", f"{hint}use one of {listing}")]
    if parent_role == "kv_producer" and role == "kv_consumer":
        return [ConfigProblem(path, "a kv_consumer child never runs under a kv_producer parent "
                                    "(the parent only sends)",
                              "make the child kv_producer or kv_both, or the parent kv_both")]
    if parent_role == "kv_consumer" and role == "kv_producer":
        return [ConfigProblem(path, "a kv_producer child never runs under a kv_consumer parent "
                                    "(the parent only receives)",
                              "make the child kv_consumer or kv_both, or the parent kv_both")]
    return []


def _check_multi(cfg: dict, prefix: str, registered: tuple[str, ...], engine: str = "v0",
                 device: str | None = None) -> list[ConfigProblem]:
    extra = cfg.get("kv_connector_extra_config")
    multi = V1_MULTI_CONNECTOR if engine == "v1" else MULTI_CONNECTOR
    parent_role = cfg["kv_role"] if cfg.get("kv_role") in ROLES else None
    example = '"connectors": [{"kv_connector": "FSConnector", "kv_role": "kv_producer", ...}, ...]'
    path = json_path(prefix, "connectors")
    if extra is None:
        return [ConfigProblem(path, f"{multi} needs a list of child connectors",
                              f"add kv_connector_extra_config with {example}")]
    if not isinstance(extra, dict):
        return [ConfigProblem(prefix, f"must be an object, got {_type_name(extra)}", f"use {{{example}}}")]
    problems = [ConfigProblem(json_path(prefix, k), f"unknown key {k!r} for {multi}",
                              _unknown_key_fix(k, MULTI_EXTRA_KEYS))
                for k in extra if k not in MULTI_EXTRA_KEYS]
    children = extra.get("connectors")
    if children is None:
        return problems + [ConfigProblem(path, "required key 'connectors' is missing", f"add {example}")]
    if not isinstance(children, list):
        return problems + [ConfigProblem(path, f"must be an array, got {_type_name(children)}",
                                         f"use {example}")]
    if not children:
        return problems + [ConfigProblem(path, f"is empty: {multi} needs at least one child",
                                         f"list the child connectors: {example}")]
    # A role problem on the parent is reported there; children then get no role check.
    for i, child in enumerate(children):
        problems += _check_config(child, json_path(path, i), registered, parent_role or "kv_both", engine, device)
    problems += _check_transfer_children(cfg, path, engine)
    return problems


def _check_transfer_children(cfg: dict, path: str, engine: str = "v0") -> list[ConfigProblem]:
    problems = []
    children = topology.children(cfg)
    marked = [c.index for c in children if c.transfer]
    for i in marked[1:]:
        problems.append(ConfigProblem(
            json_path(path, i, "kv_connector_extra_config", "transfer"),
            f"children [{marked[0]}] and [{i}] are both marked transfer: only one child moves KV from P to D",
            "keep \"transfer\": true on the child whose store the decode instance reads; "
            "set it to false on the others (they are offload copies)"))
    fs = [c for c in children if c.is_fs]
    seen: dict[str, int] = {}
    for child in fs:
        if child.store is not None:
            if child.store in seen:
                problems.append(ConfigProblem(
                    json_path(path, child.index, "kv_connector_extra_config", "fs_storage_path"),
                    f"children [{seen[child.store]}] and [{child.index}] use the same store {child.store!r}",
                    "give each FSConnector child its own directory", "warning"))
            seen.setdefault(child.store, child.index)
    if engine == "v1":
        return problems + _check_v1_children(children, path)
    sending_fs = [c.index for c in fs if c.sends]
    if not marked and sending_fs and any(not c.is_fs for c in children):
        problems.append(ConfigProblem(
            json_path(path, sending_fs[0], "kv_connector_extra_config", "transfer"),
            "no child is marked transfer, so FSConnector may key on an input another child rebuilt",
            'add "transfer": true to the FSConnector child that feeds the decode instance', "warning"))
    return problems


def _check_v1_children(children: list[topology.Child], path: str) -> list[ConfigProblem]:
    """V1's MultiConnector loads from the first child that offers tokens, and saves to all."""
    problems = []
    receiving = [c for c in children if c.receives]
    fs_recv = [c for c in receiving if c.is_fs]
    chosen = [c for c in fs_recv if c.transfer] or fs_recv
    handshake_first = bool(receiving) and receiving[0].connector in topology.HANDSHAKE_CONNECTORS
    if len(chosen) == 1 and receiving[0] is not chosen[0] and not handshake_first:  # NIXL first: it carries P->D
        first = receiving[0]
        problems.append(ConfigProblem(
            json_path(path, chosen[0].index),
            f"child [{first.index}] {first.connector} receives before this FSConnector: V1's MultiConnector "
            "loads from the first child that offers tokens, so the decode may load from it instead",
            f"list the FSConnector child first (before [{first.index}])", "warning"))
    fs_stores = {c.store: c.index for c in children if c.is_fs and c.store}
    for c in children:
        shared = c.config.get("kv_connector_extra_config")
        shared = shared.get("shared_storage_path") if isinstance(shared, dict) else None
        if c.connector in ROLE_BLIND_V1 and shared in fs_stores:
            problems.append(ConfigProblem(
                json_path(path, c.index, "kv_connector_extra_config", "shared_storage_path"),
                f"{c.connector} writes its folders into FSConnector child [{fs_stores[shared]}]'s store",
                "give it a directory of its own", "warning"))
    return problems


def open_store_dir(path: str) -> Path:
    """A connector's store dir, absolute (relative paths: the server's cwd, as in the seed).

    Creates it when missing. Raises ConfigError when it cannot be created or
    written: the server refuses to start rather than failing every publish.
    """
    root = Path(path).expanduser()
    if not root.is_absolute():
        root = Path.cwd() / root
    where = "$.kv_connector_extra_config.fs_storage_path"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError([ConfigProblem(where, f"cannot create store directory {root}: {e.strerror}",
                                         "point fs_storage_path at a directory this server can create "
                                         "and write")]) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError([ConfigProblem(where, f"store directory {root} is not writable by this server",
                                         "fix the directory's permissions or choose another fs_storage_path")])
    return root


def open_store_keys(settings: FSConnectorSettings) -> "auth.StoreKeys | None":
    """The store keys a connector signs and checks with (connectors.store.auth.keys_from), or None.

    Raises ConfigError when a key file cannot be read or a key setting holds
    no key: a server told to authenticate never falls back to serving anything.
    """
    from connectors.store import auth

    try:
        return auth.keys_from(settings.store_key_file)
    except auth.StoreKeyError as e:
        where = ("$.kv_connector_extra_config.store_key_file" if settings.store_key_file
                 else f"${auth.KEY_FILE_ENV} / ${auth.KEY_ENV}")
        raise ConfigError([ConfigProblem(where, str(e), _FS_FIX["store_key_file"])]) from None
