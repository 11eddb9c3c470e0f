"""The names kvctl and the connectors share: the vLLM engines and the P/D roles.

Standard library only, no imports: kvctl's rig recipe reads it in a bare python.
"""

ENGINES = ("v0", "v1")  # the vLLM generations a server can run (kvctl.provision.rig has a rig for each)
ROLES = ("prefill", "decode")  # what a P/D instance does (not a kv_role: connectors.config.topology)
DEFAULT_ENGINE = "v0"
