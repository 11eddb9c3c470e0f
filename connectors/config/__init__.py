"""KV-transfer config as the connectors and kvctl both read it. No torch, no vLLM.

    topology.py  which connector does what: each child's role in MultiConnectorV0 (V0) or
                 vLLM's MultiConnector (V1), which children send and receive, the
                 transfer child, where each stores, a third-party transfer connector
    validate.py  the config schema and its checks: every problem with its JSON path and fix
    names.py     the vLLM engines (v0, v1) and the P/D roles, named once for kvctl and the
                 connectors (no imports: kvctl's rig recipe reads it in a bare python)

May import: `connectors.store` and pydantic (nothing from vLLM, nothing from kvctl);
validate.py may import topology.py, never the reverse.
"""
