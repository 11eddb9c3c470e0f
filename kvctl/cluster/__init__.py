"""Clusters: the spec (what to start), the state file (what runs), and the lifecycle.

    spec.py       ClusterSpec, build_1p1d_spec and build_pd_spec: model, configs, ports, store, runtime
                  options, validated, defaults filled in; starts nothing
    parse.py      values as people type them (a kv-transfer-config as JSON, @file,
                  none or default; KEY=VALUE lists), errors naming the field
    state.py      cluster.json: ClusterState, where it lives (cluster_dir), load/save
    lifecycle.py  launch, status and down over a runtime
    router_process.py  the router launch starts beside the instances (one endpoint)
    nixl.py       what a server running vLLM's NixlConnector gets (configs, side-channel
                  ports, UCX transports, lease, the DEBUG loggers of its lines)

May import: `kvctl.runtime`, `kvctl.provision`, `kvctl.subprocesses`, `kvctl.net` (ports,
health), `kvctl.signals`, `kvctl.router` (its config: defaults and the API-key variable),
`connectors.config`, `connectors.store` (atomic writes), `kvctl.errors`, `kvctl.paths`. Never a command, a view, verify or scenario (they
build on this).
"""
