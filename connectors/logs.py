"""Loggers for the connectors that print the way vLLM's own lines do.

vLLM configures only the "vllm" logger tree (format, VLLM_LOGGING_LEVEL);
a logger named outside it would print nothing by default. Ours live under
"vllm.kvctl." so operators see our lines next to vLLM's and grep one log.
"""

from __future__ import annotations

import logging
import time

from connectors import log_lines


def get_logger(module_name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.kvctl.{module_name.rsplit('.', 1)[-1]}")


FAILURE_LOG_INTERVAL_S = 30.0  # a burst of identical send failures logs once per interval


class SendFailureLog:
    """Logs a failed publish once per burst of the same error (a full disk fails every request)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.last: tuple[str, float] = ("", 0.0)  # error kind, when last logged
        self.suppressed = 0

    def report(self, rank: int, key: str, error: Exception) -> None:
        kind = f"{type(error).__name__}:{getattr(error, 'errno', '')}"
        now = time.monotonic()
        if kind != self.last[0] or now - self.last[1] > FAILURE_LOG_INTERVAL_S:
            suppressed = self.suppressed
            self.logger.error(log_lines.KV_SEND_FAILED, rank, key, error,
                              f"; {suppressed} similar failures not logged" if suppressed else "")
            self.last, self.suppressed = (kind, now), 0
        else:
            self.suppressed += 1
