"""Store tooling on kvctl's side: inspect, check and prune an FS store.

Reads entries through `connectors.store.format` (no torch). May import `connectors.store`.
"""
