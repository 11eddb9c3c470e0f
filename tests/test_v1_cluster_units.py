"""Engine choice without servers: V1 argv and env, per-engine spec validation, the V1 load marker
and decode_skipped_forward on it, `kvctl validate`'s engine rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from connectors import log_lines
from connectors.config.validate import check_kv_transfer_config, required_engine
from kvctl.cluster.spec import build_1p1d_spec, launch_warnings
from kvctl.errors import BadInput
from kvctl.runtime.base import InstanceSpec, vllm_server_args, vllm_server_env
from kvctl.scenario.schema import check_scenario
from kvctl.views.cluster import render_launch_plan
from kvctl.views.output import Output
from kvctl.verify import markers
from kvctl.verify.checks import check_decode_skipped_forward

DONE = "INFO 05-01 12:00:00 [fs_connector.py:1] " + log_lines.KV_LOAD_DONE % (
    0, "cmpl-1", "abc", 40, 32, 1, 7, 100, 1.5)
NONE = log_lines.KV_LOAD_NONE % (0, "cmpl-2", "def", 40, 40, 0, "no entry for key def")


def _ispec(engine: str, block_size: int | None) -> InstanceSpec:
    return InstanceSpec(cluster="c", role="decode", model=Path("/m"), served_model_name="m", dtype="float32",
                        port=8000, cwd=Path("/c"), log_path=Path("/c/d.log"), engine=engine,
                        block_size=block_size, worker_cls="w.W" if engine == "v0" else None,
                        kv_transfer_config={"kv_connector": "FSConnector"})


def test_v1_server_keeps_vllm_defaults():
    args = vllm_server_args(_ispec("v1", None), model="/m", host="127.0.0.1")
    for flag in ("--block-size", "--worker-cls", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                 "--disable-frontend-multiprocessing"):
        assert flag not in args
    assert "--enforce-eager" in args and "--kv-transfer-config" in args
    env = vllm_server_env(_ispec("v1", None))
    assert "VLLM_USE_V1" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_v0_server_arguments_unchanged():
    args = vllm_server_args(_ispec("v0", 16), model="/m", host="127.0.0.1")
    assert args[args.index("--block-size") + 1] == "16"
    assert {"--worker-cls", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--disable-frontend-multiprocessing"} <= set(args)
    assert next(iter(vllm_server_env(_ispec("v0", 16)))) == "VLLM_USE_V1"


def test_spec_engines(kvctl_home, tiny_model):
    spec = build_1p1d_spec(name="mix", model=tiny_model, prefill_engine="v0", decode_engine="v1")
    assert (spec.prefill.engine, spec.decode.engine) == ("v0", "v1")
    with pytest.raises(BadInput) as e:
        build_1p1d_spec(name="mix", model=tiny_model, decode_engine="v2")
    assert e.value.fields == ("decode_engine",)
    v1_multi = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "FSConnector", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"fs_storage_path": "store"}},
                       {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"shared_storage_path": "ex"}}]}}
    with pytest.raises(BadInput):  # a V1 config on a V0 decode
        build_1p1d_spec(name="mix", model=tiny_model, decode_config=v1_multi)


def test_validate_v1_configs():
    fs = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
          "kv_connector_module_path": "connectors.v1.fs_connector",
          "kv_connector_extra_config": {"fs_storage_path": "/s"}}
    assert check_kv_transfer_config(fs, engine="v1") == []
    assert required_engine(fs) == "v1"
    assert required_engine({"kv_connector": "FSConnector"}) is None
    assert required_engine({"kv_connector": "MultiConnectorV0"}) == "v0"
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "FSConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"fs_storage_path": "/s"}},
                       {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": "/e"}, "kv_rank": 0}]}}
    problems = check_kv_transfer_config(multi, engine="v1")
    assert [p.path for p in problems] == ["$.kv_connector_extra_config.connectors[1].kv_rank"], problems
    v0 = check_kv_transfer_config({"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"connectors": []}}, engine="v1")
    assert "V0 connector" in v0[0].message and "MultiConnector" in v0[0].fix
    assert "V1 connector" in check_kv_transfer_config(multi)[0].message  # on V0


def test_v1_load_lines_parsed():
    done, none = markers.kv_loads(DONE + "\n" + NONE + "\nunrelated")
    assert (done.outcome, done.key, done.prompt_tokens, done.loaded, done.computed, done.prefix_cached) == (
        "DONE", "abc", 40, 32, 1, 7)
    assert done.skipped_prefill and not none.skipped_prefill
    assert none.reason == "no entry for key def"


def test_decode_skipped_forward_on_v1_counts():
    ok = check_decode_skipped_forward(DONE, "abc")
    assert ok.passed and "loaded=32 computed=1 of prompt_tokens=40 (prefix_cached=7)" in ok.evidence
    miss = check_decode_skipped_forward(NONE, "def")
    assert not miss.passed and "loaded nothing" in miss.evidence
    wrong = check_decode_skipped_forward(DONE.replace("computed=1", "computed=8"), "abc")
    assert not wrong.passed and "computed 8" in wrong.evidence


def test_a_v1_prefill_before_a_v0_decode_is_warned_about(kvctl_home, tiny_model):
    """V1 entries have no hidden state: a V0 D recomputes every prompt. The launch plan says so."""
    def warnings(p: str, d: str) -> list[str]:
        return launch_warnings(build_1p1d_spec(name="mix", model=tiny_model, prefill_engine=p, decode_engine=d))
    assert len(warnings("v1", "v0")) == 1 and "recomputes every prompt" in warnings("v1", "v0")[0]
    assert warnings("v0", "v1") == [] and warnings("v1", "v1") == [] and warnings("v0", "v0") == []
    out = Output(stderr=Console(record=True, width=200))
    render_launch_plan(out, build_1p1d_spec(name="mix", model=tiny_model, prefill_engine="v1",
                                            decode_engine="v0"), "asked")
    assert "warning: a V1 prefill in front of a V0 decode" in out.stderr.export_text()


def test_a_bad_scenario_engine_gets_the_engine_fix_at_both_levels():
    raw = {"name": "e", "engine": "v2", "prompts": ["hi"], "decode": 1,
           "prefill": {"engine": "vone", "kv_transfer_config": {"kv_connector": "FSConnector",
                                                              "kv_role": "kv_producer"}}}
    problems = {p.path: p for p in check_scenario(raw)}
    for path in ("$.engine", "$.prefill.engine"):
        assert problems[path].fix.startswith("use v0 or v1"), problems[path]
