"""Store tooling on kvctl's side: inspect, check and prune an FS store.

Reads entries through `connectors.store.format` (no torch).

May import: `connectors.store`, `kvctl.cluster.state` (a cluster's store key), `kvctl.errors`,
`kvctl.paths`. Never a command or a view.
"""
