"""Scenario files: a 1P1D (or xPyD) cluster, its prompts and what verification expects.

`prefill: N` / `decode: M` (or `count: N` in the role's mapping) launches a
pool of N instances of that role (kvctl.cluster.spec `build_pd_spec`); an
integer alone means N instances with the default FSConnector config on the
shared store. `via: endpoint` (the default) verifies through the cluster's
endpoint (the router) when it has one, as `kvctl verify` does; `via: direct`
sends to P and then D.

Instead of prefill/decode (a cluster kvctl launches), `cluster: {attach: FILE}`
names an attach file (kvctl.attach.file): the scenario then verifies that
running cluster and launches nothing. `expectations.require` is verify's
`--require`: `all` (default) fails on a check that is not observable,
`observable` reports it without failing.

The schema is documented for users in scenarios/README.md; `Scenario` is its
one definition. `check_scenario` reports every problem (schema, each role's
kv-transfer-config, cross-role rules) as ConfigProblems with JSON paths;
`load_scenario` returns a valid Scenario or raises BadInput.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from connectors.config.names import DEFAULT_ENGINE, ENGINES, ROLES
from connectors.config.topology import (
    FS_CONNECTOR,
    MULTI_CONNECTOR,
    acts,
    handshake_connector,
    logged_send_children,
    transfer_store,
)
from connectors.config.validate import (
    ConfigProblem,
    check_kv_transfer_config,
    json_path,
    pydantic_problems,
)
from kvctl.cluster.spec import MAX_POOL, default_kv_config, instance_names
from kvctl.errors import BadInput
from kvctl.runtime import DEFAULT_RUNTIME, RUNTIME_CHOICES, requested_runtime_class
from kvctl.runtime.docker_options import gpu_lists, parse_gpus
from kvctl.verify.checks import CHECKS
from kvctl.verify.evals import DEFAULT_TOLERANCE, EVAL_SETS

Role = Literal[ROLES]
OFFLOAD_CHECK_NAME = "offload_logged"  # kvctl.verify.checks OFFLOAD_CHECK: P with an LMCache server, or an FS offload child beside NIXL

# Replaced in kv_transfer_config strings at launch, as the server sees them:
# the shared store dir, and a dir private to the instance (e.g. an offload cache).
STORE_PLACEHOLDER = "${store}"
INSTANCE_DIR_PLACEHOLDER = "${instance_dir}"
# vLLM flags kvctl sets itself, from the named scenario field.
MANAGED_ARGS = {
    "--kv-transfer-config": "remove it; set the role's kv_transfer_config instead",
    "--port": "remove it; kvctl picks free ports",
    "--served-model-name": "remove it; set served_model_name instead",
    "--model": "remove it; set model instead",
}
SCENARIO_SUFFIXES = (".yaml", ".yml")
# Where a scenario sets each field the library names in its errors (kvctl.cluster's
# spec builder, kvctl.runtime's options, kvctl.verify): errors are located with
# `KvctlError.locate(scenario_path)`, as the CLI locates them with flags.
FIELD_PATHS = {
    "name": "$.name",
    "model": "$.model",
    "served_model_name": "$.served_model_name",
    "runtime": "$.runtime",
    "engine": "$.engine",
    "prefill_engine": "$.prefill.engine",
    "decode_engine": "$.decode.engine",
    "timeout": "$.timeout",
    "store": "$.store",
    "image": "$.image",
    "gpus": "$.gpus",
    "prefill_config": "$.prefill.kv_transfer_config",
    "decode_config": "$.decode.kv_transfer_config",
    "prefill_args": "$.prefill.args",
    "decode_args": "$.decode.args",
    "prefill_env": "$.prefill.env",
    "decode_env": "$.decode.env",
    "prefill_docker_host": "$.prefill.docker_host",
    "decode_docker_host": "$.decode.docker_host",
    "prefill": "$.prefill",  # pool sizes (kvctl.cluster.spec check_pool_sizes)
    "decode": "$.decode",
    "via_endpoint": "$.via",
    "prompts": "$.prompts",
    "max_tokens": "$.max_tokens",
    "sent_to_connectors": "$.expectations.sent_to_connectors",
    "eval": "$.eval.set",
    "compare": "$.expectations.compare",
    "epsilon": "$.expectations.epsilon",
    "eval_tolerance": "$.eval.tolerance",
    "lmcache_sharing": "$.lmcache.sharing",
    "lmcache_l1_size_gb": "$.lmcache.l1_size_gb",
    "lmcache_chunk_size": "$.lmcache.chunk_size",
    "lmcache_eviction_policy": "$.lmcache.eviction_policy",
    "lmcache_port": "$.prefill.kv_transfer_config",
}


def scenario_path(field: str) -> str | None:
    """Where a scenario sets a library field (`max_tokens` -> `$.max_tokens`); None when it cannot.

    Fields a scenario has no key for (ports, bind, concurrency) are None: the
    error then shows the field's own name.
    """
    return FIELD_PATHS.get(field)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptSpec(_Strict):
    """A prompt: plain `text`, or `repeat` joined `times` times (the seed's long prompt)."""

    text: str | None = None
    repeat: str | None = Field(default=None, min_length=1)
    times: int | None = Field(default=None, ge=1, le=100_000)

    @model_validator(mode="after")
    def _one_form(self) -> "PromptSpec":
        if (self.text is None) == (self.repeat is None):
            raise ValueError("give either text or repeat (with times)")
        if self.repeat is not None and self.times is None:
            raise ValueError("repeat needs times")
        if self.text is not None and self.times is not None:
            raise ValueError("times goes with repeat, not text")
        return self

    def render(self) -> str:
        return self.text if self.text is not None else self.repeat * (self.times or 1)


class RoleSpec(_Strict):
    """The instances of one role (prefill or decode): `count` of them, all alike."""

    kv_transfer_config: dict[str, Any]
    count: int = Field(default=1, ge=1, le=MAX_POOL)  # instances of this role (> 1: a pool behind the router)
    args: list[str] = Field(default_factory=list)  # extra vLLM server arguments
    env: dict[str, str] = Field(default_factory=dict)
    docker_host: str | None = None  # DOCKER_HOST-style URL; None = the local engine
    engine: Literal[ENGINES] | None = None  # vLLM engine of this instance; None = the scenario's

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(v, str):
                    raise ValueError(f"{k}: env values must be strings, got {v!r}; quote it in YAML")
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
                    raise ValueError(f"{k!r} is not an environment variable name")
        return value


class Expectations(_Strict):
    checks: list[Literal[CHECKS + (OFFLOAD_CHECK_NAME,)]] = Field(default_factory=lambda: list(CHECKS))
    # `sent to connector <Name>` lines P must log per request; None = derived from P's config.
    sent_to_connectors: list[str] | None = None
    # all: a check whose evidence is not observable (attached: no log source, store not
    # visible) fails the run; observable: it is reported, and does not fail it.
    require: Literal["all", "observable"] = "all"
    # output_matches_baseline: exact (CPU), or tolerant of near-ties closer than epsilon (GPU)
    compare: Literal["exact", "tolerant"] = "exact"
    epsilon: float = Field(default=0.1, gt=0)  # nats


class EvalSpec(_Strict):
    """`eval:`: the accuracy gate (kvctl.verify.evals), run after the prompts."""

    set: str = Field(default="basic", min_length=1)  # a built-in eval set, or a JSON file
    tolerance: float = Field(default=DEFAULT_TOLERANCE, ge=0, le=1)  # absolute accuracy P/D may lose
    max_tokens: int | None = Field(default=None, ge=1)  # None: the set's


class LMCacheServers(_Strict):
    """The LMCache servers kvctl runs for configs naming LMCacheMPConnector (kvctl.cluster.lmcache)."""

    sharing: Literal["per-instance", "shared"] = "per-instance"  # one per instance (P-local) | one for all
    l1_size_gb: float = Field(default=1.0, gt=0)
    chunk_size: int = Field(default=256, ge=1)
    eviction_policy: Literal["LRU", "ARC", "IsolatedLRU", "noop"] = "LRU"


class SecondRound(_Strict):
    """Verify the prompts again after restarting these roles' instances (their caches lost, the
    store and the LMCache servers kept): what LMCache serves a restarted prefill."""

    restart: list[Literal["prefill", "decode"]] = Field(default_factory=lambda: ["prefill"], min_length=1)


class ClusterRef(_Strict):
    """`cluster: {attach: FILE}`: a running cluster kvctl did not start (an attach file)."""

    attach: str = Field(min_length=1)  # relative to the scenario file's directory; $VARS expanded


class Scenario(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str = ""
    runtime: str = DEFAULT_RUNTIME  # one of kvctl.runtime.RUNTIME_CHOICES (checked by _known_runtime)
    engine: Literal[ENGINES] = DEFAULT_ENGINE  # vLLM engine of P and D (a role's `engine` overrides it)
    model: str = Field(default="tiny", min_length=1)  # "tiny", a catalog name, a path, or a hub id
    served_model_name: str | None = None
    via: Literal["endpoint", "direct"] = "endpoint"  # verify through the endpoint (when there is one), or P then D
    image: str | None = None  # docker only; None = the runtime's default image
    gpus: list[str] | None = None  # docker only: one device list per instance (["0", "1"]) or NAME=IDS items
    cluster: ClusterRef | None = None  # attach instead of launching: then no prefill/decode
    # Required unless `cluster` attaches (check_scenario says which is missing); left None
    # (the default is not validated) only in an attaching scenario: use role() / role_spec().
    # An integer N is N instances with the default config (see _pool_shorthand).
    prefill: RoleSpec = None  # type: ignore[assignment]
    decode: RoleSpec = None  # type: ignore[assignment]
    store: str | None = None  # host dir shared by P and D; None = a fresh dir per run
    prompts: list[PromptSpec] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    expectations: Expectations = Field(default_factory=Expectations)
    eval: EvalSpec | None = None  # the accuracy gate after the prompts
    timeout: float = Field(default=600, gt=0)  # seconds for the cluster to become ready
    lmcache: LMCacheServers = Field(default_factory=LMCacheServers)
    second_round: SecondRound | None = None  # a second verify after restarting instances

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str) -> str:
        if value not in RUNTIME_CHOICES:  # worded as pydantic words a Literal's error
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": " or ".join(", ".join(repr(c) for c in RUNTIME_CHOICES)
                                                               .rsplit(", ", 1))})
        return value

    @field_validator("prompts", mode="before")
    @classmethod
    def _plain_prompts(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"text": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _pool_shorthand(cls, value: Any, info: ValidationInfo) -> Any:
        """`prefill: 2`: two instances with the default FSConnector config on `${store}`."""
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= MAX_POOL:
                raise ValueError(f"the number of {info.field_name} instances must be 1 to {MAX_POOL}, got {value}")
            return {"count": value,
                    "kv_transfer_config": default_kv_config(str(info.field_name), Path(STORE_PLACEHOLDER))}
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
        return value

    def prompt_texts(self) -> list[str]:
        return [p.render() for p in self.prompts]

    @property
    def attaches(self) -> bool:
        return self.cluster is not None

    def role_spec(self, role: Role) -> RoleSpec | None:
        return self.prefill if role == "prefill" else self.decode

    def role(self, role: Role) -> RoleSpec:
        """The role's spec; raises ValueError for an attaching scenario (it has none)."""
        spec = self.prefill if role == "prefill" else self.decode
        if spec is None:
            raise ValueError(f"scenario {self.name} attaches to a cluster: it has no {role} spec")
        return spec

    def resolved_config(self, role: Role, store_dir: str,
                        instance_dir: str) -> dict[str, Any]:
        """The role's kv-transfer-config with `${store}` and `${instance_dir}` replaced."""
        values = {STORE_PLACEHOLDER: store_dir, INSTANCE_DIR_PLACEHOLDER: instance_dir}
        return _substitute(self.role(role).kv_transfer_config, values)

    def expected_sent_to(self) -> list[str]:
        """Connector names P logs `sent to connector <Name>` for, per request."""
        if self.expectations.sent_to_connectors is not None:
            return list(self.expectations.sent_to_connectors)
        return _sending_names(self.role("prefill").kv_transfer_config)


def _substitute(value: Any, values: dict[str, str]) -> Any:
    if isinstance(value, str):
        for placeholder, replacement in values.items():
            value = value.replace(placeholder, replacement)
        return value
    if isinstance(value, dict):
        return {k: _substitute(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, values) for v in value]
    return value


def _sending_names(cfg: dict) -> list[str]:
    """The connector names of P's sending children, in config order (see connectors.config.topology)."""
    return [c.connector for c in logged_send_children(cfg) if c.connector is not None]


# ---------------------------------------------------------------- checking

ENGINE_FIX = "use v0 or v1 (default v0; a role's engine overrides the scenario's)"
_FIXES = {
    "name": "use lowercase letters, digits, '.', '_' or '-', e.g. the file name without .yaml",
    "runtime": f"use {' or '.join(', '.join(RUNTIME_CHOICES).rsplit(', ', 1))}",
    "model": 'use "tiny" (the generated test model), a catalog model (`kvctl model list`), '
             'a model directory, or a hub id',
    "gpus": 'give one device list per instance, prefills first (e.g. ["0", "1"] for 1P1D), '
            'or name them: ["prefill-0=0", "decode-0=1+2"]',
    "prefill": "give a number of instances (e.g. 2), or a mapping: kv_transfer_config (required), count, args, "
               "env, docker_host; see scenarios/README.md",
    "decode": "give a number of instances (e.g. 2), or a mapping: kv_transfer_config (required), count, args, "
              "env, docker_host; see scenarios/README.md",
    "via": "use endpoint (through the cluster's router) or direct (P, then D)",
    "engine": ENGINE_FIX,
    "prefill.engine": ENGINE_FIX,
    "decode.engine": ENGINE_FIX,
    "prompts": 'list strings, or {repeat: "text", times: N} for a long prompt',
    "max_tokens": "use a whole number >= 1",
    "expectations": f"checks may list: {', '.join(CHECKS + (OFFLOAD_CHECK_NAME,))}; sent_to_connectors: connector names",
    "lmcache": "sharing: per-instance or shared; l1_size_gb > 0; chunk_size >= 1; eviction_policy: LRU, ARC, "
               "IsolatedLRU or noop",
    "second_round": "second_round: {restart: [prefill]} (the roles whose instances restart before it)",
    "timeout": "use a positive number of seconds",
    "store": "use a directory path, or null for a fresh directory per run",
    "cluster": "cluster: {attach: FILE} verifies the running cluster an attach file describes",
    "eval": f"eval: {{set: {' | '.join(EVAL_SETS)} | FILE.json, tolerance: 0.1, max_tokens: N}}",
}
# Keys that describe a cluster kvctl launches: an attaching scenario ignores them.
_LAUNCH_ONLY = ("runtime", "model", "served_model_name", "image", "gpus", "store", "timeout")


def _known_keys(parent: tuple) -> list[str]:
    """The keys allowed at a location, for did-you-mean on unknown keys."""
    model: type[BaseModel] = Scenario
    if parent[:1] in (("prefill",), ("decode",)):
        model = RoleSpec
    elif parent[:1] == ("expectations",):
        model = Expectations
    elif parent[:1] == ("prompts",):
        model = PromptSpec
    elif parent[:1] == ("cluster",):
        model = ClusterRef
    elif parent[:1] == ("eval",):
        model = EvalSpec
    elif parent[:1] == ("lmcache",):
        model = LMCacheServers
    elif parent[:1] == ("second_round",):
        model = SecondRound
    return list(model.model_fields)


def check_scenario(obj: object) -> list[ConfigProblem]:
    """Every problem in a scenario (a parsed YAML document or a Scenario)."""
    if isinstance(obj, Scenario):
        raw: Any = obj.model_dump(mode="json")
    else:
        raw = obj
    if not isinstance(raw, dict):
        return [ConfigProblem("$", f"a scenario must be a mapping, got {type(raw).__name__}",
                              "see scenarios/README.md for the schema")]
    problems: list[ConfigProblem] = []
    try:
        scenario: Scenario | None = Scenario.model_validate(raw)
    except ValidationError as e:
        scenario = None
        problems += pydantic_problems(e, "$", _known_keys, _FIXES)
    # Each role's connector config is checked even when the schema failed elsewhere. A scenario
    # that gives GPUs runs on them; every other one on CPU (the rigs and the CPU image are CPU-only).
    device = "gpu" if raw.get("gpus") else "cpu"
    for role in ("prefill", "decode"):
        spec = raw.get(role)
        cfg = spec.get("kv_transfer_config") if isinstance(spec, dict) else None
        engine = spec.get("engine") if isinstance(spec, dict) else None
        engine = engine if engine in ("v0", "v1") else raw.get("engine")
        if isinstance(cfg, dict):
            for p in check_kv_transfer_config(cfg, engine=engine if engine in ("v0", "v1") else "v0", device=device):
                p.path = "$." + role + ".kv_transfer_config" + p.path[1:]
                problems.append(p)
    missing = [] if raw.get("cluster") is not None else [r for r in ("prefill", "decode") if raw.get(r) is None]
    problems += [ConfigProblem(f"$.{role}", f"required key {role!r} is missing", _FIXES[role]) for role in missing]
    if scenario is not None and scenario.attaches:
        problems += _attach_checks(scenario, raw)
    elif scenario is not None and not missing:
        problems += _cross_checks(scenario)
    return problems


def _attach_checks(s: Scenario, raw: dict) -> list[ConfigProblem]:
    """An attaching scenario: the attach file says the instances; launch keys do nothing."""
    problems = [ConfigProblem(f"$.{role}", f"{role} is for a cluster kvctl launches; this scenario attaches",
                              "remove it: the attach file names the instances (and their kv_transfer_config)")
                for role in ("prefill", "decode") if raw.get(role) is not None]
    problems += [ConfigProblem(f"$.{key}", "ignored: the scenario attaches to a running cluster",
                               "remove it", "warning") for key in _LAUNCH_ONLY if key in raw]
    return problems


def _cross_checks(s: Scenario) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    p_cfg, d_cfg = s.role("prefill").kv_transfer_config, s.role("decode").kv_transfer_config
    if acts(p_cfg.get("kv_role"), "recv") and not acts(p_cfg.get("kv_role"), "send"):
        problems.append(ConfigProblem("$.prefill.kv_transfer_config.kv_role",
                                      "the prefill instance must send KV, but kv_consumer only receives",
                                      "use kv_producer or kv_both"))
    if acts(d_cfg.get("kv_role"), "send") and not acts(d_cfg.get("kv_role"), "recv"):
        problems.append(ConfigProblem("$.decode.kv_transfer_config.kv_role",
                                      "the decode instance must receive KV, but kv_producer only sends",
                                      "use kv_consumer (or kv_both)"))
    problems += _check_store_paths(s)
    problems += _check_placeholders(s)
    problems += _check_role_specs(s)
    sent = s.expected_sent_to()
    children = _sending_names(p_cfg)
    for i, name in enumerate(s.expectations.sent_to_connectors or []):
        if name not in children:
            problems.append(ConfigProblem(
                f"$.expectations.sent_to_connectors[{i}]",
                f"P never logs 'sent to connector {name}': it is not a sending MultiConnectorV0 child of P",
                f"expect only P's sending children: {', '.join(children) or '(none: P is not a multi connector)'}"))
    if "kv_send_logged" in s.expectations.checks and p_cfg.get("kv_connector") == MULTI_CONNECTOR and not sent:
        problems.append(ConfigProblem("$.prefill.kv_transfer_config", "P's multi connector has no sending child",
                                      "add a kv_producer or kv_both child"))
    return problems


def _check_store_paths(s: Scenario) -> list[ConfigProblem]:
    if handshake_connector(s.role("prefill").kv_transfer_config) is not None:
        return []  # NIXL carries KV P->D (verify reads its lines); an FS child there only offloads
    p_path = transfer_store(s.role("prefill").kv_transfer_config, "send")
    d_path = transfer_store(s.role("decode").kv_transfer_config, "recv")
    checks = s.expectations.checks
    problems: list[ConfigProblem] = []
    p_sends = acts(s.role("prefill").kv_transfer_config.get("kv_role"), "send")
    d_receives = acts(s.role("decode").kv_transfer_config.get("kv_role"), "recv")
    if p_path is None and p_sends and ("store_entry_written" in checks or d_path is not None):
        problems.append(ConfigProblem(
            "$.prefill.kv_transfer_config",
            "no FSConnector on P sends to the transfer store (kvctl verifies transfer through it)",
            f'use FSConnector (kv_producer), or a {MULTI_CONNECTOR} child {{"kv_connector": "{FS_CONNECTOR}", '
            '..., "transfer": true}'))
    if d_path is None and d_receives and "decode_skipped_forward" in checks:  # else a third-party D is fine
        problems.append(ConfigProblem(
            "$.decode.kv_transfer_config",
            "no FSConnector on D reads the transfer store",
            f'use {{"kv_connector": "{FS_CONNECTOR}", "kv_role": "kv_consumer", '
            f'"kv_connector_extra_config": {{"fs_storage_path": "{STORE_PLACEHOLDER}"}}}}'))
    if p_path is not None and d_path is not None and p_path != d_path:
        problems.append(ConfigProblem(
            "$.decode.kv_transfer_config",
            f"D reads {d_path!r} but P's transfer store is {p_path!r}: D would never find P's entries",
            f"use the same fs_storage_path on both, e.g. {STORE_PLACEHOLDER!r}"))
    if s.store is not None and p_path is not None and STORE_PLACEHOLDER not in p_path:
        problems.append(ConfigProblem(
            "$.store", f"store is set but the transfer path {p_path!r} does not use {STORE_PLACEHOLDER}",
            f"write fs_storage_path: {STORE_PLACEHOLDER!r} in both roles, or drop store", "warning"))
    return problems


def _check_placeholders(s: Scenario) -> list[ConfigProblem]:
    known = (STORE_PLACEHOLDER, INSTANCE_DIR_PLACEHOLDER)
    problems = []

    def walk(value: Any, path: str, count: int) -> None:
        if isinstance(value, str):
            for found in re.findall(r"\$\{[^}]*\}?", value):
                if found not in known:
                    problems.append(ConfigProblem(path, f"unknown placeholder {found!r}",
                                                  f"use {' or '.join(known)}"))
                elif found == INSTANCE_DIR_PLACEHOLDER and count > 1:
                    problems.append(ConfigProblem(
                        path, f"{found} would be one directory shared by the {count} instances of the pool "
                              "(every instance of a role gets the same config)",
                        "use a single instance of this role, or a path every instance may share"))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, json_path(path, k), count)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, json_path(path, i), count)

    for role in ("prefill", "decode"):
        walk(s.role(role).kv_transfer_config, f"$.{role}.kv_transfer_config", s.role(role).count)
    return problems


def _check_role_specs(s: Scenario) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    runtime = requested_runtime_class(s.runtime)
    ignored = f"ignored by the {runtime.name} runtime"
    for role in ("prefill", "decode"):
        spec = s.role(role)
        for i, arg in enumerate(spec.args):
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_ARGS:
                problems.append(ConfigProblem(f"$.{role}.args[{i}]", f"{flag} is set by kvctl",
                                              MANAGED_ARGS[flag]))
        v1 = spec.env.get("VLLM_USE_V1")
        if v1 is not None and v1 != "0":
            problems.append(ConfigProblem(f"$.{role}.env.VLLM_USE_V1", f"VLLM_USE_V1={v1}: V0 connectors need V0",
                                          "remove it (kvctl sets VLLM_USE_V1=0)"))
        if spec.docker_host is not None and not runtime.docker_options:
            problems.append(ConfigProblem(f"$.{role}.docker_host", ignored,
                                          "remove it, or use runtime: docker", "warning"))
    if s.gpus is not None:
        counts = (s.prefill.count, s.decode.count)
        names = instance_names(*counts, pooled=max(counts) > 1)
        try:
            gpu_lists(parse_gpus(s.gpus), names)
        except BadInput as e:
            problems.append(ConfigProblem("$.gpus", e.what, _FIXES["gpus"]))
        if not runtime.docker_options:
            problems.append(ConfigProblem("$.gpus", f"ignored by the {runtime.name} (CPU) runtime"
                                          if runtime.host_rigs else ignored,
                                          "remove it, or use runtime: docker", "warning"))
    if s.image is not None and not runtime.docker_options:
        problems.append(ConfigProblem("$.image", ignored,
                                      "remove it, or use runtime: docker", "warning"))
    if runtime.docker_options and (s.role("prefill").docker_host or "") != (s.role("decode").docker_host or ""):
        if s.store is None:
            problems.append(ConfigProblem(
                "$.store", "P and D run on different docker hosts, but store is a fresh local directory "
                           "neither host can see",
                "set store to a directory both hosts mount at the same path (e.g. NFS)"))
        else:
            problems.append(ConfigProblem(
                "$.store", f"P and D run on different docker hosts: {s.store!r} must be one shared "
                           "filesystem mounted on both (e.g. NFS), not two local directories",
                "mount the same network filesystem at this path on both hosts", "warning"))
    return problems


# ---------------------------------------------------------------- loading

def scenarios_dir() -> Path:
    """The shipped scenarios: package data in kvctl/scenario/scenarios (in a checkout,
    a link to the top-level scenarios/; a wheel or sdist holds the files)."""
    return (Path(__file__).resolve().parent / "scenarios").resolve()


def list_scenarios() -> list[Path]:
    """Shipped scenario files, sorted by name."""
    d = scenarios_dir()
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.suffix in SCENARIO_SUFFIXES and p.is_file())


def scenario_file(name_or_path: str) -> Path:
    """A scenario's file: an existing path, or a shipped scenario's name. Raises BadInput."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    looks_like_path = path.suffix in SCENARIO_SUFFIXES or "/" in name_or_path
    if not looks_like_path:
        for candidate in list_scenarios():
            if candidate.stem == name_or_path:
                return candidate
    names = ", ".join(p.stem for p in list_scenarios()) or "(none shipped)"
    if looks_like_path:
        raise BadInput(f"scenario file {name_or_path} does not exist", where=str(path.resolve()),
                       fix=f"give an existing YAML file, or a shipped scenario name: {names}")
    raise BadInput(f"unknown scenario {name_or_path!r}", where=str(scenarios_dir()),
                   fix=f"use one of: {names} (or a path to a YAML file)")


def read_scenario_yaml(path: Path) -> object:
    """The parsed YAML document. Raises BadInput for unreadable or invalid YAML."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read scenario file: {e}", where=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise BadInput(f"scenario file is not valid YAML: {problem}", where=where,
                       fix="fix the YAML syntax (indentation, quotes around values with ': ' or '#')") from None


def load_scenario(name_or_path: str) -> Scenario:
    """A valid Scenario from a shipped name or a file path.

    Raises BadInput for a missing file, bad YAML, or any error-level problem
    (all problems listed in its details). Warnings do not stop loading.
    """
    path = scenario_file(name_or_path)
    raw = read_scenario_yaml(path)
    problems = check_scenario(raw)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise BadInput(f"scenario {path.name} has {len(errors)} problem{'s' if len(errors) != 1 else ''}",
                       where=str(path), fix=f"run: kvctl validate {path}",
                       details="\n".join(str(p) for p in problems))
    return Scenario.model_validate(raw)
