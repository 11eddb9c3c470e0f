"""kvctl: launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.

kvctl never imports torch or vLLM: it drives servers (local processes or
containers) over HTTP and reads the FS store through `connectors.store.format`.
"""

__version__ = "0.1.0"
