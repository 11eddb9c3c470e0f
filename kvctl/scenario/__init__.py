"""Scenario files and `kvctl validate`'s reader: declarative 1P1D runs, checked before anything starts.

    schema.py      the YAML schema (Scenario), every problem with its JSON path, loading,
                   and FIELD_PATHS: where a scenario sets each library field (`scenario_path`)
    runner.py      plan (Scenario -> ClusterSpec, nothing started) and run: launch, verify,
                   inspect the store, down (always), the report and its JUnit XML
    catalog.py     the shipped scenarios and whether this machine can run them
    validation.py  what `kvctl validate` checks: a kv-transfer-config or a scenario

May import: `kvctl.cluster`, `kvctl.verify`, `kvctl.store`, `kvctl.runtime`, `kvctl.attach`
(attached clusters), `kvctl.provision` (what this machine can run), `kvctl.signals`,
`kvctl.errors`, `kvctl.paths`, `connectors.config`. Never a command or a view. Errors raised by
the library are located at scenario paths with `KvctlError.locate(scenario_path)`.
"""
