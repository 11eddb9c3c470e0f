"""`kvctl render k8s`: the manifests load into the official kubernetes client's models,
the seed's shape is rendered as it is (golden files), and the attach file it writes attaches.

No API server runs here; tests/test_k8s_golden/ holds the expected output. After an
intended change, regenerate it with KVCTL_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvctl.attach.attach import spec_from_file
from kvctl.cli import main
from kvctl.errors import BadInput
from kvctl.k8s.check import check_document, check_documents
from kvctl.k8s.render import K8sSpec, kubectl_commands, render_k8s, write_rendered

GOLDEN = Path(__file__).parent / "test_k8s_golden"
SEED_2P2D = K8sSpec(name="pd", prefill=2, decode=2, image="registry.example/kvctl-gpu:0.1.0", namespace="serving")


def _docs(out: Path, name: str) -> list[dict]:
    return list(yaml.safe_load_all((out / "manifests" / name).read_text()))


def test_every_manifest_loads_exactly_into_the_client_models():
    import kubernetes

    rendered = render_k8s(SEED_2P2D)
    check = check_documents(rendered.documents())
    assert check.version == kubernetes.__version__
    assert check.checked == 11 and check.problems == []  # PVC, 4 x (Service + Deployment), router's 2


def test_the_check_sees_unknown_fields_wrong_types_and_missing_names():
    doc = render_k8s(SEED_2P2D).manifests["prefill.yaml"][1]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # misspelt
    container["ports"][0]["containerPort"] = "8000"  # a string where the model wants an int
    problems = check_document(doc)
    assert any("readinesProbe: not a field" in p for p in problems), problems
    assert any("containerPort: '8000' became 8000" in p for p in problems), problems
    del container["name"]
    assert "refuses it" in check_document(doc)[0]


def test_the_check_reports_a_list_where_a_mapping_belongs():
    doc = render_k8s(SEED_2P2D).manifests["prefill.yaml"][1]
    doc["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] = ["nvidia.com/gpu"]
    problems = check_document(doc)  # the client calls .items() on the list: reported, not raised
    assert len(problems) == 1 and "V1Deployment refuses it: AttributeError" in problems[0], problems


@pytest.mark.parametrize("name", sorted(p.relative_to(GOLDEN / "seed-2p2d").as_posix()
                                        for p in (GOLDEN / "seed-2p2d").rglob("*") if p.is_file()))
def test_seed_shape_matches_golden(name, tmp_path):
    out = tmp_path / "pd"
    write_rendered(render_k8s(SEED_2P2D), out)
    text = (out / name).read_text().replace(str(out), "OUT")
    golden = GOLDEN / "seed-2p2d" / name
    if os.environ.get("KVCTL_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), f"{name} differs from {golden} (KVCTL_UPDATE_GOLDEN=1 regenerates it)"


def test_golden_files_are_all_rendered(tmp_path):
    out = tmp_path / "pd"
    written = {p.relative_to(out).as_posix() for p in write_rendered(render_k8s(SEED_2P2D), out)}
    assert written == {p.relative_to(GOLDEN / "seed-2p2d").as_posix()
                       for p in (GOLDEN / "seed-2p2d").rglob("*") if p.is_file()}


def test_seed_configs_store_gpus_and_probes(tmp_path):
    out = tmp_path / "pd"
    write_rendered(render_k8s(SEED_2P2D), out)
    claim, = _docs(out, "store-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = set()
    for role, want in (("prefill", "MultiConnectorV0"), ("decode", "FSConnector")):
        docs = _docs(out, f"{role}.yaml")
        assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
            ("Service", f"pd-{role}-0"), ("Deployment", f"pd-{role}-0"),
            ("Service", f"pd-{role}-1"), ("Deployment", f"pd-{role}-1")]
        deploy = docs[1]
        assert deploy["metadata"]["namespace"] == "serving"
        pod = deploy["spec"]["template"]["spec"]
        c = pod["containers"][0]
        config = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == want
        assert c["resources"]["requests"] == c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        store_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "kv-store")
        claim_name = next(v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "kv-store")
        assert claim_name == claim["metadata"]["name"]
        mounts.add(store_mount)
        if role == "prefill":  # the seed's shape: FS transfer child + LMCache offload child
            kids = config["kv_connector_extra_config"]["connectors"]
            assert [(k["kv_connector"], k["kv_role"]) for k in kids] == [("FSConnector", "kv_producer"),
                                                                         ("LMCacheConnector", "kv_both")]
            assert kids[0]["kv_connector_extra_config"]["transfer"] is True
            fs_path = kids[0]["kv_connector_extra_config"]["fs_storage_path"]
        else:
            assert config["kv_role"] == "kv_consumer"
            assert config["kv_connector_extra_config"]["fs_storage_path"] == fs_path
    assert mounts == {f"/workspace/{fs_path}"}  # the same path in every pod: where the config points
    deployment, service = _docs(out, "router.yaml")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--prefill") == 2 and args.count("--decode") == 2
    assert "prefill-1=http://pd-prefill-1:8000" in args and args[-4:] == ["--host", "0.0.0.0",
                                                                                     "--port", "8000"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_every_instance_is_a_one_pod_recreate_deployment_with_its_own_service():
    """Deployments, not StatefulSets or LeaderWorkerSets: one per P/D instance, never two copies of
    one running (replicas 1, Recreate), each behind a Service of its name that the router's URLs use."""
    rendered = render_k8s(K8sSpec(name="pd", prefill=3, decode=2))
    assert not [d for d in rendered.documents() if d["kind"] not in ("Deployment", "Service", "PersistentVolumeClaim")]
    router, router_service = rendered.manifests["router.yaml"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    urls = {args[i + 1] for i, a in enumerate(args) if a in ("--prefill", "--decode")}
    want_urls = set()
    for role, count in (("prefill", 3), ("decode", 2)):
        docs = rendered.manifests[f"{role}.yaml"]
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
        assert sorted(deployments) == sorted(services) == [f"pd-{role}-{i}" for i in range(count)]
        for i in range(count):
            name = f"pd-{role}-{i}"
            d, svc = deployments[name], services[name]
            assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
            assert svc["spec"]["selector"].items() <= labels.items()
            assert labels["app.kubernetes.io/component"] == role and labels["kvctl/instance"] == f"{role}-{i}"
            assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 8000
            want_urls.add(f"{role}-{i}=http://{name}:8000")
    assert urls == want_urls
    # one instance's selector picks no other instance's pods, nor the router's
    selectors = [d["spec"]["selector"]["matchLabels"] for d in rendered.documents() if d["kind"] == "Deployment"]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in rendered.documents() if d["kind"] == "Deployment"]
    for i, sel in enumerate(selectors):
        assert [j for j, labels in enumerate(pods) if sel.items() <= labels.items()] == [i]
    assert router_service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    steps = kubectl_commands(rendered.spec, Path("/out"))
    assert [s for s in steps if "rollout status" in s] == [
        f"kubectl rollout status deploy/pd-{n} --timeout=1800s"
        for n in ("prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1", "router")]


def test_existing_claim_plain_fs_scenario_and_model_claim(tmp_path):
    spec = K8sSpec(name="small", scenario="smoke-1p1d", store_pvc="shared-kv", model="/models/tiny",
                   model_pvc="models", gpus_per_pod=0)
    rendered = render_k8s(spec)
    assert "store-pvc.yaml" not in rendered.manifests
    assert check_documents(rendered.documents()).problems == []
    pod = rendered.manifests["decode.yaml"][1]["spec"]["template"]["spec"]
    assert {"name": "kv-store", "persistentVolumeClaim": {"claimName": "shared-kv"}} in pod["volumes"]
    c = pod["containers"][0]
    assert "resources" not in c and {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"  # a model path: nothing to download
    # a claim kvctl rendered before and no longer renders is not left behind to be applied again
    out = tmp_path / "d"
    write_rendered(render_k8s(K8sSpec(name="small", scenario="smoke-1p1d")), out)
    assert (out / "manifests" / "store-pvc.yaml").exists()
    write_rendered(rendered, out)
    assert not (out / "manifests" / "store-pvc.yaml").exists()


@pytest.mark.parametrize("spec,field", [
    (K8sSpec(name="Bad_Name"), "name"),
    (K8sSpec(name="1pd"), "name"),  # Service names start with a letter
    (K8sSpec(name="pd", prefill=0), "prefill"),
    (K8sSpec(name="pd", model="/data/m"), "model"),
    (K8sSpec(name="pd", namespace="Serving"), "namespace"),
])
def test_bad_render_input_names_the_field(spec, field):
    with pytest.raises(BadInput) as e:
        render_k8s(spec)
    assert e.value.fields == (field,)


def test_attach_file_attaches_with_kubectl_log_sources(tmp_path):
    out = tmp_path / "pd"
    write_rendered(render_k8s(SEED_2P2D), out)
    spec = spec_from_file(out)
    assert spec.name == "pd" and spec.endpoint == "http://127.0.0.1:18000"
    assert [(i.name, i.role, i.url) for i in spec.instances] == [
        ("prefill-0", "prefill", "http://127.0.0.1:18100"), ("prefill-1", "prefill", "http://127.0.0.1:18101"),
        ("decode-0", "decode", "http://127.0.0.1:18200"), ("decode-1", "decode", "http://127.0.0.1:18201")]
    assert spec.instances[0].log.command == "kubectl logs -f deploy/pd-prefill-0 -n serving --tail=0 -c vllm"
    assert spec.store is None and spec.served_model_name == "vllm_cpu_offload"
    script = (out / "port-forward.sh").read_text()
    assert "svc/pd-router 18000:8000" in script and "svc/pd-decode-1 18201:8000" in script
    assert subprocess.run(["sh", "-n", str(out / "port-forward.sh")]).returncode == 0
    in_cluster = spec_from_file(write_rendered(render_k8s(K8sSpec(name="pd", in_cluster=True)), tmp_path / "ic")[0]
                                .parent.parent)
    assert in_cluster.instances[0].url == "http://pd-prefill-0:8000"


def test_cli_render_then_attach_from_k8s(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    out = tmp_path / "pd"
    assert main(["render", "k8s", "pd", "--prefill", "2", "--decode", "1", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["check"]["problems"] == [] and doc["check"]["checked"] == 9
    assert doc["objects"] == ["PersistentVolumeClaim/pd-kv-store", "Service/pd-prefill-0", "Deployment/pd-prefill-0",
                              "Service/pd-prefill-1", "Deployment/pd-prefill-1", "Service/pd-decode-0",
                              "Deployment/pd-decode-0", "Deployment/pd-router", "Service/pd-router"]
    assert f"kvctl attach --from-k8s {out}" in doc["next"]
    assert main(["attach", "--from-k8s", str(out), "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["managed"] is False and state["store"] is None and state["endpoint"] == "http://127.0.0.1:18000"
    assert state["instances"]["decode-0"]["log_source"] == "cmd:kubectl logs -f deploy/pd-decode-0 --tail=0 -c vllm"
    assert main(["render", "k8s", "PD", "--out", str(out)]) == 2
    assert "where: NAME" in capsys.readouterr().err


def test_render_works_without_the_client():
    """kvctl itself never needs the kubernetes client: only the check imports it."""
    code = ("import sys; sys.modules['kubernetes'] = None\n"
            "from kvctl.k8s.check import check_documents\n"
            "from kvctl.k8s.render import K8sSpec, render_k8s\n"
            "r = check_documents(render_k8s(K8sSpec(name='pd')).documents())\n"
            "assert r.version is None and not r.ok, r\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
