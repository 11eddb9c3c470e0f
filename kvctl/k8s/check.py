"""Check rendered manifests against the official `kubernetes` Python client's models.

No API server runs here, so this is what can be proven locally: each document
is loaded into the client's model for its kind (`V1Deployment`, `V1Service`, ...), which
refuses a missing required field or a value of the wrong type, and is then
serialized back; any key that did not survive the round trip is one the
model does not know (a misspelt field), and any value that changed had the
wrong type. The client is the optional `k8s` extra, imported only here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# (apiVersion, kind) -> the client's model class name
MODELS = {
    ("v1", "Service"): "V1Service",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "Deployment"): "V1Deployment",
}


@dataclass
class ClientCheck:
    """The outcome of checking documents with the client (`version` None: not installed)."""

    version: str | None
    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.version is not None and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"client": self.version, "checked": self.checked, "problems": self.problems}


def client_version() -> str | None:
    """The installed `kubernetes` client's version, or None without the k8s extra."""
    try:
        import kubernetes
    except ImportError:
        return None
    return str(getattr(kubernetes, "__version__", "unknown"))


def _differences(want: Any, got: Any, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: became {got!r}"]
        out = []
        for key, value in want.items():
            if key not in got:
                out.append(f"{path}.{key}: not a field of the model (dropped)")
            else:
                out += _differences(value, got[key], f"{path}.{key}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: became {got!r}"]
        return [p for i, (w, g) in enumerate(zip(want, got)) for p in _differences(w, g, f"{path}[{i}]")]
    if type(want) is not type(got) or want != got:
        return [f"{path}: {want!r} became {got!r} (wrong type)"]
    return []


def check_document(doc: dict[str, Any]) -> list[str]:
    """Problems of one manifest under the client's model for its kind ([] when it loads exactly).

    Raises ImportError without the client.
    """
    from kubernetes import client

    where = f"{doc.get('kind', '?')} {doc.get('metadata', {}).get('name', '?')}"
    model = MODELS.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        return [f"{where}: no model known for {doc.get('apiVersion')}/{doc.get('kind')}"]
    api = client.ApiClient()
    try:
        # The dict -> model step every response goes through; its public wrapper
        # `deserialize` takes a response object whose shape changed across releases.
        obj = api._ApiClient__deserialize(json.loads(json.dumps(doc)), model)  # type: ignore[attr-defined]
    except (ValueError, TypeError, AttributeError) as e:
        # a missing required field (ValueError), a wrong type (TypeError), or a list where the
        # model wants a mapping (the client calls .items() on it: AttributeError)
        return [f"{where}: {model} refuses it: {type(e).__name__}: {e}"]
    back = api.sanitize_for_serialization(obj)
    return [f"{where}: {p}" for p in _differences(doc, back, "$")]


def check_documents(docs: list[dict[str, Any]]) -> ClientCheck:
    """Every document checked; ClientCheck(version=None) when the client is not installed."""
    version = client_version()
    if version is None:
        return ClientCheck(None)
    result = ClientCheck(version)
    for doc in docs:
        result.problems += check_document(doc)
        result.checked += 1
    return result
