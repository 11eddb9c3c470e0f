"""Clusters: the spec (what to start), the state file (what runs), and the lifecycle.

    spec.py       ClusterSpec: instances, configs, model, store; the cluster state file
    lifecycle.py  launch, status and down over a runtime

May import: `kvctl.runtime`, `kvctl.provision`, `connectors.config`, `kvctl.errors`, `kvctl.paths`.
"""
