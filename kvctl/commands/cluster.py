"""`kvctl launch 1p1d`, `kvctl launch pd`, `kvctl status`, `kvctl logs`, `kvctl down`.

Each command parses options, calls one function of kvctl.cluster.lifecycle, and renders
the result (rich on stderr for people, one JSON object on stdout for --json).
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

import typer

from kvctl.cluster import lifecycle
from kvctl.cluster.parse import parse_env_items, parse_kv_config
from kvctl.cluster.spec import (DEFAULT_TIMEOUT_S, DEFAULT_WORKER_CLS, ROUTER_HOST, build_1p1d_spec, build_pd_spec,
                                check_engine)
from kvctl.cluster.lmcache import CHUNK_SIZE, DEFAULT_SHARING, L1_SIZE_GB, LMCacheOptions
from kvctl.cluster.state import API_KEY_ENV, DEFAULT_NAME, check_api_key, launch_store_keys
from kvctl.runtime.base import STORE_KEY_ENVS
from kvctl.errors import BadInput, ExitCode
from kvctl.options import json_option
from kvctl.runtime import AUTO, RUNTIME_CHOICES, runtime_class, select_runtime
from kvctl.runtime.docker_options import docker_options
from kvctl.views.cluster import (
    LaunchDisplay,
    render_down,
    render_launch_interrupted,
    render_launch_plan,
    render_launched,
    render_log_lines,
    render_status,
)
from kvctl.views.output import Output
from kvctl.views.rig import ensure_rig

_ENGINE_HELP = ("vLLM engine of P and D: v0 (vLLM 0.9.2, the default) or v1 (vLLM 0.32: prefix caching "
                "and chunked prefill on); each runs from its own rig (`kvctl rig install --engine v1`).")


_NAME_HELP = "Cluster name (its state lives in $KVCTL_HOME/clusters/NAME)."
_STORE_KEY_HELP = ("Sign every store entry and serve only signed ones (a keyed BLAKE3 tag): a process that "
                   "can write the store but lacks the key cannot decide what D answers. On by default: kvctl "
                   "makes a key per cluster in CLUSTER_DIR/store_key (mode 0600); the servers get it in their "
                   "environment. --no-store-key: an unkeyed store.")
_STORE_KEY_FILE_HELP = (f"Use the store keys in PATH (one per line; the first signs, all are accepted: "
                        f"rotation, or a store shared with other clusters) instead of a new one. "
                        f"Default: ${STORE_KEY_ENVS[1]}.")
_API_KEY_HELP = (f"Every vLLM server and the router require `Authorization: Bearer KEY` on /v1/* (/health stays "
                 f"open). Default: ${API_KEY_ENV}, which keeps the key out of argv and shell history. The servers "
                 "get it in their environment, never on a command line; kvctl keeps it for verify and bench in "
                 "CLUSTER_DIR/api_key (mode 0600); status --json shows only \"api_key_required\": true.")


def launch_1p1d_cmd(
    name: str = typer.Option(DEFAULT_NAME, "--name", help=_NAME_HELP),
    runtime: str = typer.Option(AUTO, "--runtime", help=f"One of {', '.join(RUNTIME_CHOICES)}."),
    model: Path | None = typer.Option(None, "--model", help="HF model dir (default: the tiny model)."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name in API requests (default: the model dir's name)."),
    prefill_config: str | None = typer.Option(
        None, "--prefill-config", help="kv-transfer-config JSON or @file for P; 'none' for no connector."),
    decode_config: str | None = typer.Option(
        None, "--decode-config", help="kv-transfer-config JSON or @file for D; 'none' for no connector."),
    store: Path | None = typer.Option(None, "--store", help="Shared store dir (default: CLUSTER_DIR/store)."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Seconds to wait for both /health."),
    prefill_port: int = typer.Option(0, "--prefill-port", help="P's port (default: a free one)."),
    decode_port: int = typer.Option(0, "--decode-port", help="D's port (default: a free one)."),
    prefill_arg: list[str] = typer.Option([], "--prefill-arg", help="Extra vLLM argument for P (repeat; use --prefill-arg=--flag)."),
    decode_arg: list[str] = typer.Option([], "--decode-arg", help="Extra vLLM argument for D (repeat)."),
    prefill_env: list[str] = typer.Option([], "--prefill-env", help="KEY=VALUE for P's environment (repeat)."),
    decode_env: list[str] = typer.Option([], "--decode-env", help="KEY=VALUE for D's environment (repeat)."),
    worker_cls: str = typer.Option(DEFAULT_WORKER_CLS, "--worker-cls",
                                   help="vLLM --worker-cls; 'auto' for vLLM's default (no KV hooks on CPU)."),
    image: str | None = typer.Option(
        None, "--image",
        help="docker: the image (default: this checkout's cpu image; with --gpus, kvctl-gpu:latest)."),
    gpus: list[str] = typer.Option(
        [], "--gpus", metavar="GPUS", help="docker: each instance's GPUs, in order (P,D for 1p1d: 0,1; several per "
                           "instance: 0+1,2+3) or by name (prefill-0=0,prefill-1=1,decode-0=2+3); "
                           "repeatable. Default on a GPU image: instance i gets GPU i; none on the cpu image."),
    bind: str | None = typer.Option(
        None, "--bind", help="docker: host address ports are published on (default 127.0.0.1)."),
    prefill_docker_host: str | None = typer.Option(
        None, "--prefill-docker-host", help="docker: P's engine (unix://, tcp://, ssh://; default $DOCKER_HOST)."),
    decode_docker_host: str | None = typer.Option(
        None, "--decode-docker-host", help="docker: D's engine; on another host the store must be shared (NFS)."),
    engine: str = typer.Option("v0", "--engine", help=_ENGINE_HELP),
    prefill_engine: str | None = typer.Option(
        None, "--prefill-engine", help="P's engine (default: --engine), e.g. v0 with --decode-engine v1."),
    decode_engine: str | None = typer.Option(None, "--decode-engine", help="D's engine (default: --engine)."),
    transfer: str = typer.Option(
        "fs", "--transfer",
        help="What the default configs carry KV with: fs (our FSConnector, one shared store) or nixl "
             "(vLLM's NixlConnector, --engine v1: producer P, consumer D, host KV buffer, a lease sized "
             "for this host). Every NIXL instance gets its own side-channel port (checked free; "
             "VLLM_NIXL_SIDE_CHANNEL_PORT in a role's env is its first), UCX_TLS=tcp,cma, and the router "
             "relays kv_transfer_params."),
    router: bool = typer.Option(True, "--router/--no-router",
                                help="Start kvctl's router: one OpenAI endpoint (status: \"endpoint\") in "
                                     "front of P and D, on --router-host."),
    router_host: str = typer.Option(ROUTER_HOST, "--router-host", metavar="ADDR",
                                    help="The address the router listens on: 0.0.0.0 for every interface."),
    router_port: int = typer.Option(0, "--router-port", help="The router's port (default: a free one)."),
    api_key: str | None = typer.Option(None, "--api-key", metavar="KEY", show_default=False, help=_API_KEY_HELP),
    store_key: bool = typer.Option(True, "--store-key/--no-store-key", help=_STORE_KEY_HELP),
    store_key_file: Path | None = typer.Option(None, "--store-key-file", metavar="PATH", show_default=False,
                                               help=_STORE_KEY_FILE_HELP),
    lmcache_sharing: str = typer.Option(
        DEFAULT_SHARING, "--lmcache-sharing",
        help="Configs naming LMCacheMPConnector get an LMCache server kvctl runs: per-instance (one beside "
             "each such instance, P-local) or shared (one for all of them)."),
    lmcache_l1_size_gb: float = typer.Option(L1_SIZE_GB, "--lmcache-l1-size-gb",
                                             help="Each LMCache server's in-memory (L1) cache, GB."),
    lmcache_chunk_size: int = typer.Option(CHUNK_SIZE, "--lmcache-chunk-size",
                                           help="Tokens per LMCache chunk (it stores whole chunks)."),
    json_: bool = json_option("Print the cluster state as JSON."),
) -> None:
    """Launch one prefill and one decode vLLM server sharing a KV store.

    --engine v1 starts vLLM V1 servers (default v0); --prefill-engine v0
    --decode-engine v1 is the migration path (V1 decodes serve V0 entries).
    --api-key KEY (or $KVCTL_API_KEY) makes every server and the router require it.
    """
    _launch(**locals())


def _launch(*, name: str, runtime: str, model: Path | None, served_model_name: str | None,
            prefill_config: str | None, decode_config: str | None, store: Path | None, timeout: float,
            prefill_port: int, decode_port: int, prefill_arg: list[str], decode_arg: list[str],
            prefill_env: list[str], decode_env: list[str], worker_cls: str, image: str | None,
            gpus: list[str], bind: str | None, prefill_docker_host: str | None,
            decode_docker_host: str | None, engine: str, prefill_engine: str | None,
            decode_engine: str | None, router: bool, router_host: str, router_port: int,
            api_key: str | None, store_key: bool, store_key_file: Path | None, json_: bool,
            lmcache_sharing: str = DEFAULT_SHARING, lmcache_l1_size_gb: float = L1_SIZE_GB,
            lmcache_chunk_size: int = CHUNK_SIZE, transfer: str = "fs",
            pools: tuple[int, int] | None = None) -> None:
    """Both launch commands: `pools` (prefill, decode counts) for `launch pd`, None for 1p1d."""
    out = Output(json_mode=json_)
    check_engine(engine, "engine")  # before it stands in for a role's engine: name the option given
    if api_key is None and API_KEY_ENV in os.environ:  # set but empty is refused, as an empty --api-key is
        try:
            api_key = check_api_key(os.environ[API_KEY_ENV])
        except BadInput as e:
            e.where = f"${API_KEY_ENV}"  # field api_key still; the user set the variable, not the option
            raise
    chosen, why = select_runtime(runtime)
    traits = runtime_class(chosen)
    docker_given = bool(gpus) or any(v is not None for v in (image, bind, prefill_docker_host,
                                                             decode_docker_host))
    docker = (docker_options(image=image, gpus=gpus or None, bind=bind, prefill_host=prefill_docker_host,
                             decode_host=decode_docker_host)
              if traits.docker_options or docker_given else None)
    build = (build_1p1d_spec if pools is None
             else functools.partial(build_pd_spec, prefill=pools[0], decode=pools[1]))
    spec = build(
        name=name, runtime=chosen, model=model, served_model_name=served_model_name,
        prefill_config=parse_kv_config(prefill_config, "prefill_config"),
        decode_config=parse_kv_config(decode_config, "decode_config"),
        store=store, timeout_s=timeout, prefill_port=prefill_port, decode_port=decode_port,
        prefill_args=tuple(prefill_arg), decode_args=tuple(decode_arg),
        prefill_env=parse_env_items(prefill_env, "prefill_env"),
        decode_env=parse_env_items(decode_env, "decode_env"),
        worker_cls=None if worker_cls in ("auto", "") else worker_cls, docker=docker, router=router,
        prefill_engine=prefill_engine or engine, decode_engine=decode_engine or engine, api_key=api_key,
        router_host=router_host, router_port=router_port, transfer=transfer,
        store_keys=launch_store_keys(store_key, store_key_file),
        lmcache=LMCacheOptions(sharing=lmcache_sharing, l1_size_gb=lmcache_l1_size_gb,
                               chunk_size=lmcache_chunk_size))
    render_launch_plan(out, spec, why)
    if traits.host_rigs and "v0" in (spec.prefill.engine, spec.decode.engine):
        ensure_rig(out)
    try:
        with LaunchDisplay(out) as display:
            state = lifecycle.launch_1p1d(spec, progress=display)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: launch has cleaned up already
        render_launch_interrupted(out, name, e)
        raise
    render_launched(out, state)


def launch_pd_cmd(prefill: int, decode: int, **options: object) -> None:
    """Launch N prefill and M decode vLLM servers (xPyD) sharing one KV store, behind the router.

    Instances are prefill-0, ..., decode-0, ...; the router balances each pool.
    Every option of `launch 1p1d` applies (a role's config, args, env and
    engine go to each of its instances; --prefill-port/--decode-port are the
    first of consecutive ports). With --runtime docker each instance is a
    container with its own GPU list (--gpus prefill-0=0,decode-0=1, or one
    list per instance in order).
    """
    _launch(pools=(prefill, decode), **options)  # type: ignore[arg-type]


# `launch pd` takes launch 1p1d's options plus the two pool sizes: one list of options, not two.
launch_pd_cmd.__signature__ = inspect.signature(launch_1p1d_cmd).replace(parameters=[  # type: ignore[attr-defined]
    inspect.Parameter("prefill", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(..., "--prefill", min=1, help="How many prefill instances (N).")),
    inspect.Parameter("decode", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(..., "--decode", min=1, help="How many decode instances (M).")),
    *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
      for p in inspect.signature(launch_1p1d_cmd).parameters.values())])
launch_pd_cmd.__annotations__ = {**launch_1p1d_cmd.__annotations__, "prefill": "int", "decode": "int"}


def status_cmd(
    name: str | None = typer.Option(None, "--name", help="One cluster (default: list all)."),
    json_: bool = json_option("Print JSON."),
) -> None:
    """Show clusters and whether their servers run and answer /health.

    With --name, exits 1 when a server is not healthy.
    """
    out = Output(json_mode=json_)
    statuses, damaged = ([lifecycle.cluster_status(name)], []) if name else lifecycle.all_cluster_status()
    render_status(out, statuses, damaged, one=name is not None)
    if name and not statuses[0].healthy:
        raise typer.Exit(ExitCode.CHECK_FAILED)


def logs_cmd(
    instance: str = typer.Argument(..., metavar="INSTANCE",
                                   help="An instance: prefill or decode (1P1D), prefill-0, decode-1, ... "
                                        "(pools; `kvctl status` lists them), or router."),
    name: str = typer.Option(DEFAULT_NAME, "--name", help=_NAME_HELP),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines while it runs."),
    tail: int | None = typer.Option(None, "--tail", "-n", min=0, help="Only the last K lines."),
) -> None:
    """Print a server's log (stdout)."""
    inst = lifecycle.instance(name, instance)
    try:
        render_log_lines(inst.logs(tail=tail, follow=follow), flush_each=follow)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how --follow ends
    except FileNotFoundError:
        raise BadInput(f"the {instance} log is missing: {inst.log_path}", where=str(inst.log_path),
                       fix=f"relaunch the cluster (`kvctl down --name {name}` first)") from None


def down_cmd(
    name: str = typer.Option(DEFAULT_NAME, "--name", help=_NAME_HELP),
    keep_store: bool = typer.Option(False, "--keep-store", help="Keep the store dir."),
    json_: bool = json_option("Print JSON."),
) -> None:
    """Stop a cluster's servers and remove its state (idempotent)."""
    out = Output(json_mode=json_)
    render_down(out, lifecycle.down(name, keep_store=keep_store))


def register(app: typer.Typer) -> None:
    launch_app = typer.Typer(help="Launch a cluster.", no_args_is_help=True)
    launch_app.command("1p1d")(launch_1p1d_cmd)
    launch_app.command("pd")(launch_pd_cmd)
    app.add_typer(launch_app, name="launch")
    app.command("status")(status_cmd)
    app.command("logs")(logs_cmd)
    app.command("down")(down_cmd)
