"""The attach file: a cluster kvctl did not start, as YAML.

    name: serving                    # optional: the cluster name (kvctl attach's NAME wins)
    served_model_name: llama         # optional: asked from the first prefill's /v1/models
    model: meta-llama/Llama-3.1-8B   # optional, for people: what the servers load
    endpoint: http://router:8000     # optional: the router in front of the instances
    store: /mnt/kv-store             # optional: the store as seen from where kvctl runs;
                                     #   absent or null: not visible here
    prefill:                         # one instance (a mapping, named "prefill") or a list
      - name: prefill-0              #   (names default to prefill-0, prefill-1, ...)
        url: http://10.0.0.5:8000
        log: cmd:kubectl logs -f deploy/pd-prefill-0 -n serving --tail=0   # or a file path
        kv_transfer_config: {...}    # optional: what the server runs with
    decode:
      - {name: decode-0, url: http://10.0.0.6:8000, log: /var/log/vllm/decode-0.log}

Where a scenario has the same key (name, model, served_model_name, store,
prefill/decode.kv_transfer_config) it means the same thing. Relative paths
(store, log files) are relative to the file's directory. `check_attach_file`
lists every problem with its JSON path; `read_attach_file` raises BadInput
with all of them; `dump_attach_file` writes one (kvctl.k8s renders one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors.config.validate import ConfigProblem, check_kv_transfer_config, pydantic_problems, required_engine
from connectors.config.names import DEFAULT_ENGINE, ROLES
from kvctl.errors import BadInput

INSTANCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

_FIXES = {
    "name": "use letters, digits, '.', '_' or '-' (at most 63, not starting with '.' or '-')",
    "url": "use the server's base URL as seen from here, e.g. http://10.0.0.5:8000",
    "log": "a log file path, or cmd:COMMAND whose output is the log (e.g. cmd:kubectl logs -f --tail=0 pod/x)",
    "endpoint": "use the router's base URL, e.g. http://10.0.0.4:8000, or leave it out",
    "store": "the store directory as seen from here, or leave it out when it is not visible here",
    "kv_transfer_config": "the server's --kv-transfer-config as a mapping, or leave it out",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InstanceEntry(_Strict):
    """One server of a pool."""

    name: str | None = Field(default=None, pattern=INSTANCE_NAME)
    url: str = Field(min_length=1)
    log: str | None = None  # a file path or cmd:COMMAND; None: not observable from here
    kv_transfer_config: dict[str, Any] | None = None


class _Top(_Strict):
    name: str | None = Field(default=None, pattern=INSTANCE_NAME)
    description: str = ""
    model: str | None = None
    served_model_name: str | None = Field(default=None, min_length=1)
    endpoint: str | None = None
    store: str | None = None
    prefill: Any
    decode: Any


@dataclass(frozen=True)
class AttachFileInstance:
    name: str
    role: str
    url: str
    log: str | None
    kv_transfer_config: dict | None


@dataclass(frozen=True)
class AttachFile:
    """A checked attach file; paths are still as written (see `resolve`)."""

    name: str | None
    model: str | None
    served_model_name: str | None
    endpoint: str | None
    store: str | None
    instances: tuple[AttachFileInstance, ...]
    description: str = ""


def _pool(raw: Any, role: str) -> tuple[list[tuple[str, dict]], list[ConfigProblem]]:
    """(JSON path, mapping) of each instance of a pool; a mapping is one instance named `role`."""
    where = f"$.{role}"
    if isinstance(raw, dict):
        return [(where, {"name": role, **raw})], []
    if isinstance(raw, list) and raw:
        found, problems = [], []
        for i, item in enumerate(raw):
            if isinstance(item, dict):
                found.append((f"{where}[{i}]", {"name": f"{role}-{i}", **item}))
            else:
                problems.append(ConfigProblem(f"{where}[{i}]", f"must be a mapping, got {type(item).__name__}",
                                              "give name, url and log of the instance"))
        return found, problems
    if raw is None:
        return [], [ConfigProblem(where, f"required key {role!r} is missing",
                                  f"list the {role} instances: name, url, log")]
    return [], [ConfigProblem(where, f"must be a mapping (one instance) or a non-empty list, got {raw!r}"[:160],
                              f"list the {role} instances: name, url, log")]


def check_attach_file(raw: object) -> tuple[AttachFile | None, list[ConfigProblem]]:
    """The attach file in `raw` (parsed YAML) and every problem in it (JSON paths)."""
    if not isinstance(raw, dict):
        return None, [ConfigProblem("$", f"an attach file must be a mapping, got {type(raw).__name__}",
                                    "see docs/k8s.md for the schema")]
    problems: list[ConfigProblem] = []
    top: _Top | None = None
    try:
        top = _Top.model_validate({"prefill": None, "decode": None, **raw})
    except ValidationError as e:
        problems += pydantic_problems(e, "$", list(_Top.model_fields), _FIXES)
    instances: list[AttachFileInstance] = []
    for role in ROLES:
        entries, pool_problems = _pool(raw.get(role), role)
        problems += pool_problems
        for where, item in entries:
            try:
                entry = InstanceEntry.model_validate(item)
            except ValidationError as e:
                problems += pydantic_problems(e, where, list(InstanceEntry.model_fields), _FIXES)
                continue
            if entry.kv_transfer_config is not None:
                # checked for the engine it names (a V1-only connector such as NixlConnector: v1)
                engine = required_engine(entry.kv_transfer_config) or DEFAULT_ENGINE
                for p in check_kv_transfer_config(entry.kv_transfer_config, engine=engine):
                    p.path = f"{where}.kv_transfer_config{p.path[1:]}"
                    problems.append(p)
            url = entry.url.rstrip("/")
            if not re.match(r"^https?://[^/\s]+$", url):
                problems.append(ConfigProblem(f"{where}.url", f"{entry.url!r} is not a base URL", _FIXES["url"]))
            instances.append(AttachFileInstance(entry.name or role, role, url, entry.log, entry.kv_transfer_config))
    seen: dict[str, int] = {}
    for inst in instances:
        seen[inst.name] = seen.get(inst.name, 0) + 1
    for name, count in seen.items():
        if count > 1:
            problems.append(ConfigProblem("$", f"instance name {name!r} is used {count} times",
                                          "give every instance its own name"))
    if top is not None and top.endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", top.endpoint):
        problems.append(ConfigProblem("$.endpoint", f"{top.endpoint!r} is not a base URL", _FIXES["endpoint"]))
    errors = [p for p in problems if p.severity == "error"]
    if top is None or errors:
        return None, problems
    return AttachFile(name=top.name, model=top.model, served_model_name=top.served_model_name,
                      endpoint=top.endpoint.rstrip("/") if top.endpoint else None, store=top.store,
                      instances=tuple(instances), description=top.description), problems


def read_attach_file(path: Path) -> AttachFile:
    """The attach file at `path`. Raises BadInput (every problem in its details)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read attach file: {e}", where=str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise BadInput(f"attach file is not valid YAML: {getattr(e, 'problem', None) or e}", where=where,
                       fix="fix the YAML syntax") from None
    parsed, problems = check_attach_file(raw)
    if parsed is None:
        errors = [p for p in problems if p.severity == "error"]
        first = errors[0] if errors else None
        raise BadInput(f"attach file {path.name} has {len(errors)} problem{'s' if len(errors) != 1 else ''}"
                       + (f": {first.path}: {first.message}" if first else ""),
                       where=str(path), fix=first.fix if first else None,
                       details="\n".join(str(p) for p in problems))
    return parsed


class _PlainDumper(yaml.SafeDumper):
    """No anchors or aliases: instances sharing a config each spell it out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_attach_file(data: AttachFile) -> str:
    """The YAML text of an attach file (pools as lists), readable by `read_attach_file`."""
    doc: dict[str, Any] = {}
    if data.name is not None:
        doc["name"] = data.name
    if data.description:
        doc["description"] = data.description
    for key in ("model", "served_model_name", "endpoint", "store"):
        value = getattr(data, key)
        if value is not None:
            doc[key] = value
    for role in ROLES:
        doc[role] = [{k: v for k, v in (("name", i.name), ("url", i.url), ("log", i.log),
                                         ("kv_transfer_config", i.kv_transfer_config)) if v is not None}
                     for i in data.instances if i.role == role]
    return yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, allow_unicode=True, width=100)
