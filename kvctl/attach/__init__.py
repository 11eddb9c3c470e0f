"""Clusters kvctl did not start: register them (`kvctl attach`) and forget them (`kvctl detach`).

    file.py    the attach file (`kvctl attach NAME --file cluster.yaml`): its schema, every
               problem with its JSON path, and writing one (kvctl.k8s renders one per deployment)
    attach.py  AttachSpec (from options or a file), `attach_cluster` (validates, asks the
               served model name when not given, writes cluster.json with `managed: false`)
               and `detach_cluster`

An attached cluster is a cluster.json like a launched one (kvctl.cluster.state
documents the added fields), so status, verify, inspect-store and scenarios read
it the same way; nothing here starts, stops or changes a server.

May import: `kvctl.cluster` (state only), `kvctl.client` (asking the served model),
`kvctl.errors`, `kvctl.paths`, `connectors.config`. Never a command, a view, verify or scenario (they build on this).
Library code: nothing here prints; errors name fields (`prefill_log`), never CLI flags.
"""
