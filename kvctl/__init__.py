"""kvctl: launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.

kvctl never imports torch or vLLM: it drives servers (local processes or
containers) over HTTP and reads the FS store through `connectors.store.format`.

May import: `connectors.store`, `connectors.config`, `connectors.log_lines` (no torch in
any). The rig-side benchmarks `kvctl.bench.store` and `kvctl.bench.layout` run inside
the rig and also import the torch side of connectors.
"""

__version__ = "0.1.0"
