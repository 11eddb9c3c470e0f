"""`kvctl scenario list` tells the truth about where each scenario runs.

A scenario runs here only when nothing it needs is missing: GPUs when it asks
for devices, the docker engine and the image for the docker runtime, the
variables its model path names ($KVCTL_MODELS), the V1 rig for a local engine
v1 role. The machine is a stand-in `Host` here, so these tests do not depend
on what this machine has.
"""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import yaml
from rich.console import Console

from kvctl.scenario import catalog
from kvctl.scenario.schema import scenarios_dir
from kvctl.views.output import Output
from kvctl.views.scenario import render_scenario_list


class FakeHost(catalog.Host):
    def __init__(self, *, gpus=True, engine=True, images=(), rigs=("v0", "v1"), env=None):
        super().__init__(env=env or {})
        self.has = {"gpus": gpus, "engine": engine, "images": set(images), "rigs": set(rigs)}

    def gpus_missing(self):
        return None if self.has["gpus"] else "no nvidia-smi"

    def engine_missing(self):
        return None if self.has["engine"] else "no Docker engine answers"

    def image_missing(self, ref):
        if not self.has["engine"]:
            return "no Docker engine answers"
        return None if ref in self.has["images"] else f"{ref} is not on the docker engine"

    def default_image(self, gpus, engine):  # the runtime's rule (catalog.Host.default_image)
        suffix = "" if engine == "v0" else f"-{engine}"
        return f"kvctl-gpu{suffix}:latest" if gpus else f"kvctl-cpu{suffix}:abc"

    def rig_missing(self, engine):
        return None if engine in self.has["rigs"] else f"the {engine} rig is not installed"


def shipped(name: str) -> Path:
    return scenarios_dir() / f"{name}.yaml"


def test_gpu_scenario_on_a_machine_without_gpus_names_each_missing_thing():
    row = catalog.describe_scenario(shipped("fs-1p1d-gpu"), FakeHost(gpus=False, images=()))
    assert row["valid"] and row["runnable"] is False
    assert row["missing"] == ["GPUs", "image kvctl-gpu:latest", "$KVCTL_MODELS"]
    assert "no nvidia-smi" in row["note"] and "KVCTL_MODELS" in row["note"]


def test_gpu_scenario_runs_where_gpus_image_and_model_cache_are():
    host = FakeHost(images={"kvctl-gpu:latest"}, env={"KVCTL_MODELS": "/models"})
    row = catalog.describe_scenario(shipped("seed-replica-gpu"), host)
    assert row["runnable"] is True and row["missing"] == [] and row["note"].startswith("docker:")


def test_no_docker_engine_is_named_instead_of_the_image():
    row = catalog.describe_scenario(shipped("fs-1p1d-gpu"),
                                    FakeHost(engine=False, env={"KVCTL_MODELS": "/m"}))
    assert row["missing"] == ["docker engine"]


def test_local_v1_scenario_needs_the_v1_rig_not_the_v0_one(tmp_path):
    doc = yaml.safe_load(shipped("smoke-1p1d").read_text())
    path = tmp_path / "v1.yaml"
    path.write_text(yaml.safe_dump({**doc, "name": "v1", "engine": "v1"}))
    assert catalog.describe_scenario(path, FakeHost(rigs=("v0",)))["missing"] == ["V1 rig"]
    assert catalog.describe_scenario(path, FakeHost(rigs=("v1",)))["runnable"] is True
    # The V0 rig is installed by `kvctl scenario run` itself: never "missing".
    assert catalog.describe_scenario(shipped("smoke-1p1d"), FakeHost(rigs=()))["runnable"] is True


def test_invalid_scenario_row_has_an_empty_missing_list(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nprompts: []\n")
    row = catalog.describe_scenario(path, FakeHost())
    assert (row["valid"], row["runnable"], row["missing"]) == (False, False, [])


def test_real_host_probe_without_nvidia(monkeypatch, tmp_path):
    monkeypatch.setattr(catalog, "NVIDIA_SMI", "no-such-nvidia-smi-tool")
    monkeypatch.setattr(catalog, "NVIDIA_DEVICES", str(tmp_path / "nvidia[0-9]*"))
    assert "no-such-nvidia-smi-tool" in catalog.Host(env={}).gpus_missing()
    (tmp_path / "nvidia0").write_text("")
    assert catalog.Host(env={}).gpus_missing() is None


def test_list_view_says_no_and_what_is_missing():
    buf = StringIO()
    out = Output(stdout=Console(file=buf, width=200), stderr=Console(file=StringIO()))
    rows = catalog.describe_shipped(FakeHost(gpus=False))
    render_scenario_list(rows, out)
    text = buf.getvalue()
    line = next(ln for ln in text.splitlines() if ln.startswith("fs-1p1d-gpu"))
    assert "no (missing GPUs, image kvctl-gpu:latest, $KVCTL_MODELS)" in line
    assert "yes" in next(ln for ln in text.splitlines() if ln.startswith("smoke-1p1d"))


def test_shipped_v1_scenarios_validate_and_run_on_v1():
    from kvctl.scenario.schema import check_scenario, load_scenario

    for name, runtime in (("v1-fs-1p1d", "local"), ("v1-fs-1p1d-gpu", "docker")):
        assert check_scenario(yaml.safe_load(shipped(name).read_text())) == []
        s = load_scenario(name)
        assert (s.name, s.engine, s.runtime) == (name, "v1", runtime)
        assert all(s.role(r).engine is None for r in ("prefill", "decode"))  # both roles on v1
    assert load_scenario("v1-fs-1p1d-gpu").image == "kvctl-gpu-v1:latest"
    row = catalog.describe_scenario(shipped("v1-fs-1p1d-gpu"), FakeHost(env={"KVCTL_MODELS": "/m"}))
    assert row["missing"] == ["image kvctl-gpu-v1:latest"]


def test_validate_accepts_the_v1_scenario(kvctl):
    r = kvctl("validate", "v1-fs-1p1d")
    assert r.rc == 0, r


def images_v1_cpu() -> str:
    from kvctl.provision.images import default_image

    return default_image("cpu", "v1")


def test_docker_v1_scenario_without_an_image_needs_the_v1_cpu_image(tmp_path):
    doc = yaml.safe_load(shipped("v1-fs-1p1d-gpu").read_text())
    doc.pop("image", None)
    doc.pop("gpus", None)
    path = tmp_path / "v1-docker.yaml"
    path.write_text(yaml.safe_dump(doc))
    row = catalog.describe_scenario(path, FakeHost(images={"kvctl-cpu:abc"}, env={"KVCTL_MODELS": "/m"}))
    assert row["missing"] == ["image kvctl-cpu-v1:abc"], row


def test_host_default_image_follows_the_runtime_rule():
    host = catalog.Host(env={})
    assert host.default_image(False, "v1") == images_v1_cpu()
    assert host.default_image(True, "v1") == "kvctl-gpu-v1:latest"
    assert host.default_image(True, "v0") == "kvctl-gpu:latest"
