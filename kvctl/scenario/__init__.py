"""Scenario files: the schema (YAML -> Scenario) and the runner (launch, verify, inspect, down).

May import: `kvctl.cluster`, `kvctl.verify`, `kvctl.store`, `kvctl.runtime`, `connectors.config`.
"""
