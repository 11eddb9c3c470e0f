"""What `kvctl validate` checks: a kv-transfer-config (inline JSON, @file, .json) or a scenario.

Reading the target and choosing the engine to check a config for are the
only things added here (a config that names a V1-only connector or a
`kv_connector_module_path` is checked as V1, else as V0; the JSON result's
`"engine"` says which engine the config needs: "v0", "v1", or "any" when
either runs it, FSConnector alone); the checks are
connectors.config.validate's and kvctl.scenario.schema's. Nothing is started.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from connectors.config.validate import ConfigProblem, check_kv_transfer_config, required_engine
from kvctl.errors import BadInput
from kvctl.scenario.schema import SCENARIO_SUFFIXES, check_scenario, read_scenario_yaml, scenario_file


ENGINE_ANY = "any"  # a config both engines run (FSConnector alone)


@dataclass
class ValidationResult:
    target: str
    kind: str  # "kv_transfer_config" or "scenario"
    problems: list[ConfigProblem]
    engine: str | None = None  # a kv_transfer_config's: "v0", "v1" or "any" (ENGINE_ANY); None for a scenario

    @property
    def errors(self) -> list[ConfigProblem]:
        return [p for p in self.problems if p.severity == "error"]

    def to_json(self) -> dict:
        return {"target": self.target, "kind": self.kind, "valid": not self.errors,
                "errors": len(self.errors), "warnings": len(self.problems) - len(self.errors),
                "problems": [asdict(p) for p in self.problems],
                **({"engine": self.engine} if self.engine is not None else {})}


def validate_target(target: str) -> ValidationResult:
    """Read the target and check it: inline JSON (`{...}`), `@file`, a `.json` file, or a scenario
    (a YAML path or a shipped name).

    Raises BadInput if it cannot be read (missing file, bad JSON or YAML, unknown scenario).
    """
    text = target.strip()
    if text.startswith("{") or text.startswith("["):
        return _config_result("inline JSON", _json(text, "argument"))
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        return _config_result(str(path), _json_file(path))
    path = Path(text).expanduser()
    if path.suffix == ".json":
        return _config_result(str(path), _json_file(path))
    if path.is_file() and path.suffix not in SCENARIO_SUFFIXES:
        raise BadInput(f"{target}: not a .json, .yaml or .yml file", where=str(path),
                       fix="give inline JSON, @config.json, a .json file, or a scenario .yaml")
    scenario = scenario_file(text)  # BadInput names the shipped scenarios
    return ValidationResult(str(scenario), "scenario", check_scenario(read_scenario_yaml(scenario)))


def _config_result(target: str, cfg: object) -> ValidationResult:
    """Check `cfg` for the engine it needs (V0 when either runs it)."""
    engine = required_engine(cfg)
    return ValidationResult(target, "kv_transfer_config", check_kv_transfer_config(cfg, engine=engine or "v0"),
                            engine=engine or ENGINE_ANY)


def _json_file(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"config file {path} does not exist", where=str(path.absolute()),
                       fix="give an existing JSON file, or the JSON itself in quotes") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read config file: {e}", where=str(path)) from None
    return _json(text, str(path))


def _json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", where=where,
                       fix="quote the whole JSON for the shell ('{...}') and use double quotes inside") from None
