"""MultiConnectorV0: several vLLM V0 KV connectors in one instance.

Fan-out rule: **receive from the first child that serves, send to all.**

- Children are full KVTransferConfig dicts under
  ``kv_connector_extra_config.connectors``, each built through vLLM's own V0
  factory from a copy of the config, so any registered V0 connector works.
- recv: consumer children in config order; the first that bypasses the
  forward pass or rebuilds ``model_input`` (e.g. LMCache on a partial hit)
  wins. A child that raises is logged and skipped.
- send: every producer child in config order, each logged as
  ``sent to connector <Name>``; a child that raises is logged and the
  others still run, so one broken child never fails the request.
- Which child sends, which receives and which is marked transfer is
  `connectors.config.topology`'s rule (a child acts by its own ``kv_role``,
  only on the sides its parent's role runs), read from there, never here.
- Transfer children (``"transfer": true``) hand a prompt to another instance
  and must key on the whole prompt: they get the ``model_input`` seen
  *before* recv, with hidden states realigned to it, even when another child
  rebuilt the input to prefill only the uncached suffix.
- Children get the same KV and hidden-state objects; the contract is that a
  connector's send reads them and never writes (checked in tests).
- One gather per step: when two or more sending children are FSConnectors,
  they share one `SharedGathers` for the step, so a request's KV is
  gathered from the paged cache once and the same token-major tensor is
  saved by each (each child still logs its own ``KV send DONE``, with
  ``gather_ms`` its own share: ~0 when it reused another's gather). Any
  other child gets the paged caches through the plain V0 API.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from connectors.config import topology
from connectors.config.validate import ConfigError, validate_kv_transfer_config
from connectors.v0.batch import split_prefills
from connectors.v0.kv_layout import SharedGathers
from connectors import log_lines
from connectors.logs import get_logger
from connectors.registry import registered_connectors
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


@dataclass
class Child:
    index: int
    name: str
    connector: KVConnectorBase
    is_producer: bool
    is_consumer: bool
    transfer: bool

    @property
    def label(self) -> str:
        return f"child {self.index} {self.name}"


class MultiConnectorV0(KVConnectorBase):
    """Runs several V0 KV connectors: receive from the first that serves, send to all."""

    def __init__(self, rank: int, local_rank: int, config: "VllmConfig"):
        self.rank = rank
        kv_config = config.kv_transfer_config
        as_dict = {k: getattr(kv_config, k) for k in
                   ("kv_connector", "kv_role", "kv_connector_extra_config")}
        try:
            validate_kv_transfer_config(as_dict, registered=registered_connectors())
        except ConfigError as e:
            logger.error("MultiConnectorV0: invalid --kv-transfer-config:\n%s", e)
            raise
        self._use_children([])
        try:
            for spec in topology.children(as_dict):
                self.children.append(self._build_child(spec, rank, local_rank, config))
        except BaseException:
            self.close()
            raise
        self._use_children(self.children)
        logger.info("MultiConnectorV0 ready: %s", ", ".join(
            f"[{c.index}] {c.name} ({'transfer, ' if c.transfer else ''}"
            f"{'send' if c.is_producer else ''}{'+' if c.is_producer and c.is_consumer else ''}"
            f"{'recv' if c.is_consumer else ''})" for c in self.children))

    def _use_children(self, children: list[Child]) -> None:
        """Run these children (built ones; tests hand in their own)."""
        self.children = children
        self._input_before_recv = None
        # Sending children that take a shared gather (FSConnectors): one gather per step for all.
        sharing = [c for c in children if c.is_producer and hasattr(c.connector, "shared_gathers")]
        self._sharing = sharing if len(sharing) > 1 else []
        self._gathers = SharedGathers() if self._sharing else None

    @staticmethod
    def _build_child(spec: topology.Child, rank, local_rank, config) -> Child:
        """Build one child through vLLM's V0 factory; what it does is the topology's answer."""
        child_kv_config = KVTransferConfig(**copy.deepcopy(dict(spec.config)))
        child_vllm_config = copy.copy(config)
        child_vllm_config.kv_transfer_config = child_kv_config
        connector = KVConnectorFactory.create_connector_v0(rank, local_rank, child_vllm_config)
        return Child(spec.index, child_kv_config.kv_connector, connector,
                     spec.sends, spec.receives, spec.transfer)

    def recv_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module, model_input,
                                         kv_caches: list[torch.Tensor]):
        self._input_before_recv = model_input
        for child in self.children:
            if not child.is_consumer:
                continue
            try:
                hidden, bypass, new_input = child.connector.recv_kv_caches_and_hidden_states(
                    model_executable, model_input, kv_caches)
            except Exception as e:
                logger.error(log_lines.CHILD_RECV_FAILED, self.rank, child.index, child.name, _summary(e))
                continue
            if bypass or new_input is not model_input:
                logger.info(log_lines.CHILD_RECEIVED, self.rank, child.name, child.index, child.name,
                            "skip forward" if bypass else "rebuilt input")
                return hidden, bypass, new_input
        return None, False, model_input

    def send_kv_caches_and_hidden_states(self, model_executable: torch.nn.Module, model_input,
                                         kv_caches: list[torch.Tensor],
                                         hidden_or_intermediate_states) -> None:
        original = self._input_before_recv
        self._input_before_recv = None  # one step only: never reuse a stale input
        if self._gathers is None:
            self._send_children(model_executable, model_input, kv_caches, hidden_or_intermediate_states,
                                original)
            return
        self._gathers.start_step()
        for child in self._sharing:
            child.connector.shared_gathers = self._gathers
        try:
            self._send_children(model_executable, model_input, kv_caches, hidden_or_intermediate_states,
                                original)
        finally:
            for child in self._sharing:
                child.connector.shared_gathers = None
            self._gathers.start_step()  # drop this step's tensors now, not at the next step

    def _send_children(self, model_executable, model_input, kv_caches, hidden_or_intermediate_states,
                       original) -> None:
        transfer_args = None
        for child in self.children:
            if not child.is_producer:
                continue
            child_input, child_hidden = model_input, hidden_or_intermediate_states
            if child.transfer and original is not None and original is not model_input:
                if transfer_args is None:
                    transfer_args = (original, _realign_hidden(original, model_input,
                                                               hidden_or_intermediate_states))
                child_input, child_hidden = transfer_args
            start = time.perf_counter()
            try:
                child.connector.send_kv_caches_and_hidden_states(
                    model_executable, child_input, kv_caches, child_hidden)
            except Exception as e:
                logger.error(log_lines.CHILD_SEND_FAILED, self.rank, child.index, child.name, _summary(e))
                continue
            logger.info(log_lines.CHILD_SENT, child.name, child.index,
                        (time.perf_counter() - start) * 1e3)

    def close(self) -> None:
        """Close every child, even when one fails; re-raise the first failure at the end."""
        first_error = None
        for child in self.children:
            try:
                child.connector.close()
            except Exception as e:
                logger.error("%s failed in close: %s", child.label, _summary(e))
                first_error = first_error or e
        if first_error is not None:
            raise first_error


def _realign_hidden(original, rebuilt, hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states of a rebuilt (suffix-only) prefill, placed at the original positions.

    A child that rebuilt the input prefills only each prompt's uncached
    suffix, so request i's computed rows end where its original span ends.
    Rows for the skipped prefix are zero; FSConnector reads only each
    prompt's last row.
    """
    orig_spans = split_prefills(original).spans
    new_spans = split_prefills(rebuilt).spans
    if len(orig_spans) != len(new_spans) or not torch.is_tensor(hidden):
        return hidden
    out = hidden.new_zeros((orig_spans[-1].end if orig_spans else 0, *hidden.shape[1:]))
    for o, n in zip(orig_spans, new_spans):
        rows = min(n.num_tokens, o.num_tokens)
        out[o.end - rows:o.end] = hidden[n.end - rows:n.end]
    return out


def _summary(e: BaseException) -> str:
    """One line: exception, message and the innermost frame, for the log."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {e}{where}"
