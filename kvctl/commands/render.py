"""`kvctl render k8s`: write a P/D deployment's Kubernetes manifests and its attach file."""

from __future__ import annotations

from pathlib import Path

import typer

from kvctl.errors import BadInput, ExitCode
from kvctl.k8s.check import check_documents
from kvctl.k8s.render import (
    DEFAULT_IMAGE,
    DEFAULT_MODEL,
    DEFAULT_SCENARIO,
    DEFAULT_STORE_SIZE,
    K8sSpec,
    render_k8s,
    write_rendered,
)
from kvctl.options import json_option
from kvctl.views.k8s import render_k8s_result
from kvctl.views.output import Output

render_app = typer.Typer(help="Render deployments for other platforms (nothing is applied).", no_args_is_help=True)


@render_app.command("k8s")
def k8s_cmd(
    name: str = typer.Argument(..., help="Deployment name (prefix of every object; lowercase, digits, '-')."),
    prefill: int = typer.Option(1, "--prefill", help="Prefill pods."),
    decode: int = typer.Option(1, "--decode", help="Decode pods."),
    out: Path = typer.Option(..., "--out", help="Directory to write (manifests/, attach.yaml, port-forward.sh)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Hub id, or a path under /models with --model-pvc."),
    served_model_name: str | None = typer.Option(None, "--served-model-name",
                                                 help="Model name in requests (default: the scenario's)."),
    image: str = typer.Option(DEFAULT_IMAGE, "--image", help="vLLM + kvctl connectors image "
                                                             "(`kvctl image build gpu`, pushed)."),
    router_image: str | None = typer.Option(None, "--router-image", help="Router image (default: --image)."),
    scenario: str = typer.Option(DEFAULT_SCENARIO, "--scenario",
                                 help="Scenario whose kv-transfer-configs, args and env the pods run."),
    namespace: str | None = typer.Option(None, "--namespace", help="Namespace (default: kubectl's)."),
    store_pvc: str | None = typer.Option(None, "--store-pvc", help="An existing ReadWriteMany claim for the "
                                                                   "store (default: render one)."),
    store_size: str = typer.Option(DEFAULT_STORE_SIZE, "--store-size", help="Size of the rendered store claim."),
    storage_class: str | None = typer.Option(None, "--storage-class", help="Its storage class (must offer RWX)."),
    gpus_per_pod: int = typer.Option(1, "--gpus-per-pod", help="nvidia.com/gpu per vLLM pod."),
    model_pvc: str | None = typer.Option(None, "--model-pvc", help="Claim with model dirs, mounted at /models."),
    model_cache_pvc: str | None = typer.Option(None, "--model-cache-pvc", help="Claim for the hub cache."),
    hf_token_secret: str | None = typer.Option(None, "--hf-token-secret", help="Secret with key `token` "
                                                                               "(HF_TOKEN)."),
    in_cluster: bool = typer.Option(False, "--in-cluster", help="attach.yaml with in-cluster DNS URLs (run "
                                                                "kvctl in the cluster) instead of port-forwards."),
    attach_store: str | None = typer.Option(None, "--attach-store", help="The store volume as mounted where "
                                                                         "kvctl runs (attach.yaml's store)."),
    json_: bool = json_option("Print what was written as JSON."),
) -> None:
    """Write Kubernetes manifests for NAME: a Deployment + Service per P and D, the router, a RWX store claim.

    Also writes DIR/attach.yaml (`kvctl attach --from-k8s DIR`, logs through
    `kubectl logs -f`) and DIR/port-forward.sh. Nothing is applied. When the
    `kubernetes` client is installed (the k8s extra), every manifest is loaded
    into its models; exit 1 if one does not load exactly.
    """
    output = Output(json_mode=json_)
    spec = K8sSpec(name=name, prefill=prefill, decode=decode, model=model, served_model_name=served_model_name,
                   image=image, router_image=router_image, scenario=scenario, namespace=namespace,
                   store_pvc=store_pvc, store_size=store_size, storage_class=storage_class,
                   gpus_per_pod=gpus_per_pod, model_pvc=model_pvc, model_cache_pvc=model_cache_pvc,
                   hf_token_secret=hf_token_secret, in_cluster=in_cluster, attach_store=attach_store)
    try:
        rendered = render_k8s(spec)
    except BadInput as e:
        if e.fields == ("name",) and e.where is None:
            e.where = "NAME"  # an argument here, not the usual --name option
        raise
    check = check_documents(rendered.documents())
    files = write_rendered(rendered, out)
    render_k8s_result(output, rendered, out, files, check)
    if check.problems:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


def register(app: typer.Typer) -> None:
    app.add_typer(render_app, name="render")
