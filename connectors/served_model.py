"""The `model` part of FSConnector's store keys, from the server's vLLM config.

Two instances may share an entry only if the same token ids give the same KV
on both. For one model that takes the same weights and architecture
(connectors.store.model_identity: a Hugging Face commit or a content
fingerprint; FSConnector's ``model_id`` setting names them instead) and the
same serving settings that change the KV computed from those weights:

    dtype                    model dtype, which is also the hidden states' dtype
    quantization             e.g. fp8 quantized at load time
    rope_scaling, rope_theta RoPE overrides
    hf_overrides             config overrides (a function is named by its qualified name)
    hf_config                identity of a config taken from elsewhere (hf_config_path)
    code_revision            revision of remote modeling code
    disable_sliding_window   sliding window turned off
    override_attention_dtype attention computed in another dtype

The KV cache dtype, layout and TP are separate identity fields. Requests
whose KV depends on more than token ids are handled per step
(connectors.v0.batch) and, for prompt embeddings, refused at start-up here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.config.validate import ConfigProblem
from connectors.store.model_identity import served_model_key, weights_identity

if TYPE_CHECKING:
    from vllm.config import ModelConfig


def served_model_identity(model_config: "ModelConfig", model_id: str | None) -> tuple[str, str]:
    """(the `model` string for KVIdentity, a description for the start-up log).

    Raises ModelIdentityError when `model_id` is None and the weights cannot
    be identified (see connectors.store.model_identity.weights_identity).
    """
    if model_id is not None:
        weights, described = model_id, f"model_id {model_id!r} from the connector config"
    else:
        found = weights_identity(model_config.model, revision=getattr(model_config, "revision", None))
        weights, described = found.id, found.describe()
    serving = serving_settings(model_config)
    return served_model_key(weights, serving), described


def serving_settings(model_config: "ModelConfig") -> dict[str, object]:
    """The settings (besides the weights) that change a prompt's KV; defaults come out empty."""
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        overrides = f"{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"
    config_path = getattr(model_config, "hf_config_path", None)
    return {
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": getattr(model_config, "quantization", None),
        "rope_scaling": getattr(model_config, "rope_scaling", None),
        "rope_theta": getattr(model_config, "rope_theta", None),
        "hf_overrides": overrides,
        "hf_config": weights_identity(config_path).id if config_path else None,
        "code_revision": getattr(model_config, "code_revision", None),
        "disable_sliding_window": getattr(model_config, "disable_sliding_window", False),
        "override_attention_dtype": getattr(model_config, "override_attention_dtype", None),
    }


def unkeyable_input_problems(model_config: "ModelConfig") -> list[ConfigProblem]:
    """Start-up problems for server settings under which token ids do not name the prompt."""
    problems = []
    if getattr(model_config, "enable_prompt_embeds", False):
        problems.append(ConfigProblem(
            "--enable-prompt-embeds", "prompt embeddings have no token ids (vLLM passes zeros), "
            "so FSConnector would give different prompts one key",
            "start vLLM without --enable-prompt-embeds"))
    return problems

