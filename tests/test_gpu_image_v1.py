"""`kvctl image build gpu --engine v1`: the V1 GPU image's Dockerfile and build context.

The image cannot be built here (no registry, no GPU): these tests check what
kvctl hands the engine. The base is the official vLLM image of the V1 rig's
vLLM version, LMCache is pinned, the overlay (this kvctl's connectors and the
vLLM plugin entry point) goes in last, and the V0 GPU image is unchanged.
A stand-in engine client records the build kvctl asks for.
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import docker.errors
import pytest

from kvctl.errors import BadInput
from kvctl.provision import images, rig

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"kvctl.python": "python3"}


def dockerfile_v1() -> str:
    return (ROOT / "docker" / "Dockerfile.gpu-v1").read_text()


def test_v1_base_is_the_official_image_of_the_v1_rigs_vllm():
    vllm_version = rig.V1_VLLM[0].partition("==")[2]
    assert images.DEFAULT_GPU_BASES["v1"] == f"vllm/vllm-openai:v{vllm_version}" == "vllm/vllm-openai:v0.32.0"
    assert f"ARG BASE_IMAGE=vllm/vllm-openai:v{vllm_version}\n" in dockerfile_v1()
    assert images.DEFAULT_GPU_BASES["v0"] == images.DEFAULT_GPU_BASE == "vllm/vllm-openai:v0.9.2"


def test_v1_dockerfile_pins_lmcache_keeps_the_base_and_adds_the_overlay_last():
    text = dockerfile_v1()
    pin = re.search(r"^ARG LMCACHE_VERSION=(\S+)$", text, re.MULTILINE)
    assert pin and re.fullmatch(r"\d+\.\d+\.\d+", pin[1])  # an exact release, not a range
    assert '"lmcache==${LMCACHE_VERSION}"' in text and "-c /tmp/base-pins.txt" in text
    assert "patch-vllm-lmcache" not in text  # V1's LMCache connector needs no patch
    lines = [ln for ln in text.splitlines() if ln.startswith(("COPY", "RUN", "ENV PYTHONPATH"))]
    assert lines[-2:] == ["COPY overlay/ /opt/kvctl/overlay/", "ENV PYTHONPATH=/opt/kvctl/overlay"]
    assert "kvctl.engine=v1" in text and "ENTRYPOINT []" in text
    assert (images.DOCKERFILES / "Dockerfile.gpu-v1").is_file()  # package data, as the others


def test_v1_plan_context_and_tag():
    v1 = images.plan_gpu(images.DEFAULT_GPU_BASES["v1"], "sha256:base1", LABELS, engine="v1")
    v0 = images.plan_gpu(images.DEFAULT_GPU_BASE, "sha256:base0", LABELS)
    files = dict(v1.files)
    assert re.fullmatch(r"kvctl-gpu-v1:[0-9a-f]{16}", v1.tag) and v0.tag.startswith("kvctl-gpu:")
    assert files["Dockerfile"] == dockerfile_v1().encode() and v1.dockerfile == "Dockerfile.gpu-v1"
    assert v1.build_args == {"BASE_IMAGE": "vllm/vllm-openai:v0.32.0", "PYTHON": "python3"}
    assert "build/ca.crt" in files and "build/patch-vllm-lmcache.py" not in files
    assert files["overlay/connectors/plugin.py"] == (ROOT / "connectors" / "plugin.py").read_bytes()
    assert any(n.startswith("overlay/connectors/v1/") for n in files)  # the V1 FSConnector
    eps = next(d for n, d in files.items() if n.endswith(".dist-info/entry_points.txt"))
    assert b"kvctl_connectors = connectors.plugin:register" in eps
    # The V0 plan is what it was: its Dockerfile and patch, its repo.
    assert dict(v0.files)["Dockerfile"] == (ROOT / "docker" / "Dockerfile.gpu").read_bytes()
    assert "build/patch-vllm-lmcache.py" in dict(v0.files)
    # The tar the engine gets holds exactly these files.
    with tarfile.open(fileobj=v1.context()) as tar:
        assert sorted(tar.getnames()) == sorted(files)
    # Keyed by the base's id; a kvctl CPU base (a test build) installs LMCache without deps.
    assert images.plan_gpu(v1.base_image, "sha256:other", LABELS, engine="v1").tag != v1.tag
    cpu_base = images.plan_gpu("kvctl-cpu:x", "sha256:c", {"kvctl.device": "cpu"}, engine="v1")
    assert cpu_base.build_args["LMCACHE_PIP_ARGS"] == "--no-deps"


def test_default_gpu_image_per_engine():
    assert images.default_image("gpu") == "kvctl-gpu:latest"
    assert images.default_image("gpu", "v1") == "kvctl-gpu-v1:latest"


class _Image:
    def __init__(self, ref: str, store: dict, labels: dict | None = None):
        self.id, self.labels, self.tags = f"sha256:{abs(hash(ref)):x}", labels or {}, [ref]
        self.attrs = {"Size": 1_000_000, "Created": ""}
        self._store = store

    def tag(self, repo: str, tag: str) -> None:
        self._store[f"{repo}:{tag}"] = self


class FakeClient:
    """The engine calls build_image makes: images.get/list/remove/pull, api.build."""

    def __init__(self, present: dict[str, dict]):
        self.store = {ref: _Image(ref, {}, labels) for ref, labels in present.items()}
        self.builds: list[dict] = []
        self.images, self.api = self, self

    def get(self, ref):
        if ref not in self.store:
            raise docker.errors.ImageNotFound(ref)
        return self.store[ref]

    def list(self, name=None):
        return []

    def pull(self, ref):
        raise docker.errors.APIError(f"no registry for {ref}")

    def build(self, fileobj, tag, buildargs, **kw):
        with tarfile.open(fileobj=io.BytesIO(fileobj.read())) as tar:
            names = tar.getnames()
        self.builds.append({"tag": tag, "buildargs": buildargs, "files": names, "labels": kw["labels"]})
        self.store[tag] = _Image(tag, self.store)
        return iter([{"stream": "Step 1/9 : ARG BASE_IMAGE\n"}, {"stream": "done\n"}])


def test_build_gpu_v1_builds_from_the_v1_base_and_moves_latest(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path))
    client = FakeClient({"vllm/vllm-openai:v0.32.0": {}})
    result = images.build_image("gpu", engine="v1", client=client)
    (build,) = client.builds
    assert build["buildargs"]["BASE_IMAGE"] == "vllm/vllm-openai:v0.32.0" and "Dockerfile" in build["files"]
    assert result.tag == build["tag"] and result.tag.startswith("kvctl-gpu-v1:") and not result.cached
    assert "kvctl-gpu-v1:latest" in client.store and "kvctl-gpu:latest" not in client.store
    again = images.build_image("gpu", engine="v1", client=client)
    assert again.cached and len(client.builds) == 1


def test_missing_v1_base_that_cannot_be_pulled_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path))
    with pytest.raises(BadInput) as e:
        images.build_image("gpu", engine="v1", client=FakeClient({}))
    assert "vllm/vllm-openai:v0.32.0" in e.value.what and e.value.fields == ("base_image",)


@pytest.mark.parametrize("kind, engine, field", [("cpu", "v2", "engine"), ("gpu", "v2", "engine")])
def test_bad_engine_is_refused_before_any_engine_call(kind, engine, field):
    with pytest.raises(BadInput) as e:
        images.build_image(kind, engine=engine, client=object())
    assert e.value.fields == (field,)


def test_cli_passes_the_engine(kvctl):
    r = kvctl("image", "build", "cpu", "--engine", "v2", "--json")  # an engine it does not know
    assert r.rc == 2 and '"where": "--engine"' in r.stdout and "v2" in r.stdout, r
