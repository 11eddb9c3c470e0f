"""FSConnector refuses, at server start, settings it cannot serve correctly.

The checks themselves are unit-tested on small config objects; one real vLLM
server shows the operator sees the message (field + fix) and the server stops.
"""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest
import vllm  # noqa: F401  (runs in the rig; a missing vLLM must fail, not skip)

from connectors.config.validate import ConfigError  # noqa: E402
from connectors.config.validate import open_store_dir  # noqa: E402
from connectors.v0.fs_connector import _refuse_unsupported  # noqa: E402


def vllm_config(prefix=False, chunked=False, pp=1):
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                           scheduler_config=SimpleNamespace(chunked_prefill_enabled=chunked),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pp))


@pytest.mark.parametrize("kwargs,flag,fix", [
    (dict(prefix=True), "--enable-prefix-caching", "--no-enable-prefix-caching"),
    (dict(chunked=True), "--enable-chunked-prefill", "--no-enable-chunked-prefill"),
    (dict(pp=2), "--pipeline-parallel-size", "--pipeline-parallel-size 1"),
])
def test_unsupported_settings_are_refused_with_the_flag_to_change(kwargs, flag, fix):
    with pytest.raises(ConfigError) as e:
        _refuse_unsupported(vllm_config(**kwargs))
    [problem] = e.value.problems
    assert problem.path == flag and fix in problem.fix


def test_supported_settings_pass():
    _refuse_unsupported(vllm_config())


def test_relative_store_path_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_store_dir("fs_local_storage") == tmp_path / "fs_local_storage"
    assert (tmp_path / "fs_local_storage").is_dir()


def test_store_path_that_cannot_be_created_names_the_field(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as e:
        open_store_dir(str(blocker / "store"))
    [problem] = e.value.problems
    assert problem.path.endswith("fs_storage_path") and "cannot create" in problem.message


@pytest.mark.e2e
@pytest.mark.xdist_group("vllm")
def test_real_server_stops_with_the_message(rig_python, tiny_model, tmp_path, vllm_slot):
    """A vLLM server started with FSConnector and prefix caching exits and says which flag to change."""
    env = {**os.environ, "VLLM_USE_V1": "0", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    cfg = ('{"kv_connector":"FSConnector","kv_role":"kv_consumer",'
           '"kv_connector_extra_config":{"fs_storage_path":"fs_local_storage"}}')
    cmd = [str(rig_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--port", "0", "--host", "127.0.0.1", "--dtype", "float32", "--block-size", "16",
           "--max-model-len", "512", "--enforce-eager", "--disable-frontend-multiprocessing",
           "--enable-prefix-caching", "--no-enable-chunked-prefill",
           "--worker-cls", "connectors.v0.cpu_worker.KVTransferCPUWorker", "--kv-transfer-config", cfg]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "FSConnector: cannot start" in log
    assert "--enable-prefix-caching: prefix caching makes a prefill compute only part" in log
    assert "start vLLM with --no-enable-prefix-caching" in log
