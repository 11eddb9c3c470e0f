"""A vLLM V0 CPU worker that runs KV connectors (pass it with --worker-cls).

vLLM 0.9.2's stock CPU worker never creates the KV connector and its model
runner never calls send/recv, so --kv-transfer-config is silently ignored.
This worker creates the connector after the distributed environment exists
(as the GPU worker does) and its runner calls recv before the forward pass
and send after it, in the GPU runner's order (vllm/worker/model_runner.py):

    recv (consumer, real prefill step) -> forward unless bypassed -> send
    (producer, real prefill step) -> logits -> sample

Usage: ``--worker-cls connectors.v0.cpu_worker.KVTransferCPUWorker``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from connectors.logs import get_logger
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
from vllm.forward_context import set_forward_context
from vllm.multimodal import MultiModalKwargs
from vllm.sequence import IntermediateTensors
from vllm.worker.cpu_model_runner import CPUModelRunner, ModelInputForCPUWithSamplingMetadata
from vllm.worker.cpu_worker import CPUWorker

logger = get_logger(__name__)


class KVTransferCPUModelRunner(CPUModelRunner):
    """CPUModelRunner.execute_model with the V0 KV-transfer hooks added."""

    def _is_real_prefill(self, model_input, kv_caches) -> bool:
        # Same test as the GPU runner's need_recv_kv/need_send_kv: not the
        # profile run (empty caches) and the step has prefills.
        return bool(kv_caches) and kv_caches[0].numel() > 0 and \
            model_input.attn_metadata.prefill_metadata is not None

    def execute_model(
        self,
        model_input: ModelInputForCPUWithSamplingMetadata,
        kv_caches: List[torch.Tensor],
        intermediate_tensors: Optional[IntermediateTensors] = None,
        num_steps: int = 1,
        previous_hidden_states: Optional[torch.Tensor] = None,
    ):
        kv_config = self.vllm_config.kv_transfer_config
        if kv_config is None or not kv_config.is_kv_transfer_instance:
            return super().execute_model(model_input, kv_caches, intermediate_tensors,
                                         num_steps, previous_hidden_states)
        if num_steps > 1:
            raise ValueError("CPU worker does not support multi-step execution.")
        if self.lora_config:
            self.set_active_loras(model_input.lora_requests, model_input.lora_mapping)

        model_executable = self.model
        real_prefill = self._is_real_prefill(model_input, kv_caches)
        bypass_model_exec = False
        if kv_config.is_kv_consumer and real_prefill:
            hidden_states, bypass_model_exec, model_input = \
                get_kv_transfer_group().recv_kv_caches_and_hidden_states(
                    model_executable, model_input, kv_caches=kv_caches)

        if not bypass_model_exec:
            multimodal_kwargs = {}
            if model_input.multi_modal_kwargs is not None:
                multimodal_kwargs = MultiModalKwargs.as_kwargs(
                    model_input.multi_modal_kwargs, device=self.device)
            execute_model_kwargs = {}
            if previous_hidden_states is not None:
                execute_model_kwargs["previous_hidden_states"] = previous_hidden_states
            with set_forward_context(model_input.attn_metadata, self.vllm_config,
                                     model_input.virtual_engine):
                hidden_states = model_executable(
                    input_ids=model_input.input_tokens,
                    positions=model_input.input_positions,
                    intermediate_tensors=intermediate_tensors,
                    **execute_model_kwargs,
                    **multimodal_kwargs,
                )

        if kv_config.is_kv_producer and real_prefill:
            get_kv_transfer_group().send_kv_caches_and_hidden_states(
                model_executable, model_input, kv_caches, hidden_states)

        logits = self.model.compute_logits(hidden_states, model_input.sampling_metadata)
        if not self.is_driver_worker:
            return []
        output = self.sampler(logits=logits, sampling_metadata=model_input.sampling_metadata)
        if self.return_hidden_states:
            if model_input.is_prompt:
                output.prefill_hidden_states = hidden_states
            output.hidden_states = hidden_states
        return [output]


class KVTransferCPUWorker(CPUWorker):
    """CPUWorker that initialises the KV connector and uses the hooked runner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.model_runner) is not CPUModelRunner:
            raise ValueError(
                f"KVTransferCPUWorker supports decoder-only generation models; this model "
                f"uses {type(self.model_runner).__name__}. Drop --worker-cls or the KV transfer config.")
        # Same construction arguments as the stock runner; nothing is loaded yet.
        runner = self.model_runner
        self.model_runner = KVTransferCPUModelRunner(
            vllm_config=self.vllm_config,
            kv_cache_dtype=runner.kv_cache_dtype,
            is_driver_worker=runner.is_driver_worker,
            return_hidden_states=runner.return_hidden_states,
        )

    def init_device(self) -> None:
        super().init_device()
        # The GPU worker does this in init_worker_distributed_environment.
        ensure_kv_transfer_initialized(self.vllm_config)
        kv_config = self.vllm_config.kv_transfer_config
        if kv_config is not None and kv_config.is_kv_transfer_instance:
            logger.info("KV transfer enabled on the CPU worker: connector=%s role=%s",
                        kv_config.kv_connector, kv_config.kv_role)
