"""KV-transfer config as the connectors and kvctl both read it. No torch, no vLLM.

    validate.py  the config schema and its checks: every problem with its JSON path and fix

May import: `connectors.store` (nothing from vLLM, nothing from kvctl).
"""
