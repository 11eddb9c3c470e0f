"""Loggers for the connectors that print the way vLLM's own lines do.

vLLM configures only the "vllm" logger tree (format, VLLM_LOGGING_LEVEL);
a logger named outside it would print nothing by default. Ours live under
"vllm.kvctl." so operators see our lines next to vLLM's and grep one log.
"""

from __future__ import annotations

import logging


def get_logger(module_name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.kvctl.{module_name.rsplit('.', 1)[-1]}")
