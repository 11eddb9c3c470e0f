"""Values of a cluster spec as people type them: kv-transfer-configs and KEY=VALUE lists.

Library-level parsing: each function takes the name of the field it parses
(`prefill_config`, `decode_env`, ...) and raises BadInput naming that field,
so every front end (CLI flags, scenario paths) can say where the value came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvctl.cluster.spec import DEFAULT_CONFIG, DefaultConfig
from kvctl.errors import BadInput


def parse_kv_config(value: str | None, field: str) -> dict | None | DefaultConfig:
    """A kv-transfer-config value: JSON, @file, `none` or `default` (also None).

    Returns the config dict, None for `none` (no connector) or DEFAULT_CONFIG.
    Raises BadInput naming `field` for an unreadable file, invalid JSON or a
    value that is not a JSON object.
    """
    if value is None or value.strip().lower() == "default":
        return DEFAULT_CONFIG
    if value.strip().lower() == "none":
        return None
    text, source = value, "the value"
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        source = str(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}", field=field,
                           fix="pass an existing JSON file as @PATH, or the JSON itself") from None
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise BadInput(f"{source} is not valid JSON: {e}", field=field,
                       fix="pass a kv-transfer-config JSON object, e.g. "
                           '\'{"kv_connector":"FSConnector","kv_role":"kv_producer",...}\'') from None
    if not isinstance(cfg, dict):
        raise BadInput(f"a kv-transfer-config must be a JSON object, got {type(cfg).__name__}",
                       field=field, fix='pass an object like {"kv_connector": ..., "kv_role": ...}')
    return cfg


def parse_env_items(items: list[str] | tuple[str, ...], field: str) -> dict[str, str]:
    """["KEY=VALUE", ...] as a dict. Raises BadInput naming `field` for an item without '='."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"expected KEY=VALUE, got {item!r}", field=field,
                           fix="write it as NAME=VALUE")
        env[key] = value
    return env
