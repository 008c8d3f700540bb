"""Graph files: the YAML that ``kvmesh serve`` runs. One pydantic schema (``Graph``) and its loader.

A graph names a namespace, where etcd and NATS are (``embedded``: kvmesh starts them on loopback, or external
endpoints), the runtime settings of every process, the frontend, and groups of workers::

    namespace: demo
    infrastructure: {etcd: embedded, nats: embedded}
    runtime: {lease_ttl_s: 10}
    frontend: {port: 8000, router_policy: kv, max_retries: 3}
    workers:
      - {name: mock, engine: mock, model: tiny-llama, model_path: models/tiny-llama, replicas: 2, num_workers: 8,
         speedup_ratio: 10}

Each section IS its component's config, derived, not re-declared: ``runtime`` is ``RuntimeConfig`` (less the
endpoints, which ``infrastructure`` gives), ``frontend`` is ``FrontendConfig`` (less the namespace, which the graph
gives) plus how the deployment runs it (``enabled``, ``graceful_timeout_s``), and a worker group is ``WorkerConfig``
plus its engine's config (``MockEngineConfig`` or ``VllmEngineConfig``, picked by ``engine``) plus ``_GroupFields``
(name, replicas, GPUs, env); a graph only tightens a few of WorkerConfig's own fields (``_TIGHTENED``: ``model`` and
``model_path`` are required, ``component`` must be a mesh name), keeping their type and description. A field added
to a component's config is a graph field at once, validated by that config's own rules, and becomes that component's
flag through ``components.runtime.flags.argv_for`` (plan.py): no option is declared twice, and no argv is written by
hand.

Disaggregated serving is the same: a group's ``role`` (aggregated, prefill or decode) and a decode group's
``max_local_prefill_length``/``max_prefill_queue_size`` are WorkerConfig fields, validated there (a threshold on a
non-decode group is refused). What one group cannot see is checked across groups (``_role_problems``): a model's
decode groups need prefill groups and the other way round, and a model is not served both aggregated and decode.

A graph written for the schema before this one (``frontend.router``, ``frontend.args``, ``workers[i].engine_args``)
is refused, not accepted with a deprecation warning: each old key gets an error at its line that spells out what to
write instead (``frontend.router: ... write router_policy: kv``, ``workers[0].engine_args: ... speedup_ratio: 10``).
Accepting them would keep two spellings of every option alive, and a warning is easily missed (a ``--detach``ed
serve writes it to a log nobody reads); the old ``args``/``engine_args`` also took any flag spelling
(``max-retries``), which a rewrite would have to guess at. Every other old field kept its name.

Every model forbids unknown fields, so a typo is an error rather than a silently ignored key. ``load_graph`` turns
every problem into a ``GraphProblem`` that names the file, the line, the field path (``workers[0].replicas``) and
what is allowed; a YAML syntax error names its line and column.

Relative paths (``model_path``) resolve against the graph's *base directory*: the parent of the directory holding
the graph file, so ``graphs/x.yaml`` refers to ``models/tiny-llama`` as the repository does. A graph kept elsewhere
sets ``base_dir`` (itself relative to the graph file's own directory, e.g. ``base_dir: .``). ``--set`` overrides are
applied to the parsed YAML before validation, so their errors are reported like any other.

``planner`` (optional) is the planner's own configs, ``PlannerConfig`` (intervals, thresholds, GPU budget,
``no_operation``) and ``PlannerRunConfig`` (model, TensorBoard directory, Prometheus port, scaling timeout), less what
the graph decides (``namespace``; ``environment``, always ``local``: the circus arbiter serve runs; ``state_dir``,
serve's), plus ``graceful_timeout_s``. With it, ``kvmesh serve`` starts ``kvmesh planner --environment local`` as one
more watcher, ``<namespace>-planner``. ``served_model_name`` may be left out when the graph serves one model; it must
name a model the graph's workers serve. A relative ``log_dir`` resolves against the base directory, as
``model_path`` does. ``components/planner/config.py`` is imported although the planner package ranks above this one:
it is a pure config module (standard library and pydantic only), a leaf any package may import
(tests/unit/test_layering.py).

``rescheduler`` (optional) is the rescheduler's configs, ``ReschedulerConfig`` (policies, interval, thresholds, what a
pair moves, the call timeout) and ``ReschedulerRunConfig`` (the workers' component, Prometheus host and port), less
``namespace`` and ``state_dir`` (serve's), plus ``graceful_timeout_s``. The section is the switch:
``enable_rescheduling`` defaults to true in it (false keeps the section and runs nothing). With it, ``kvmesh serve``
starts ``kvmesh rescheduler`` as one more watcher, ``<namespace>-rescheduler``; with ``colocated_rescheduling_mode:
true`` it starts none and the frontend runs the loop instead (``kvmesh frontend --enable-rescheduling
--colocated-rescheduling-mode`` and the section's policy fields): that needs the graph's frontend, with ``replicas:
1``, and takes none of ``ReschedulerRunConfig``'s fields (a colocated rescheduler calls the ``backend`` workers and
serves its metrics on a free loopback port).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from components.deploy.errors import GraphError, GraphProblem, OverrideError
from components.frontend.config import FrontendConfig
from components.planner.config import PlannerConfig, PlannerRunConfig, SlaPlannerConfig, policy_config
from components.protocol.metadata import WorkerRole
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.run_config import ReschedulerRunConfig
from components.runtime.config import RuntimeConfig, parse_host_port
from components.runtime.errors import ConfigError
from components.runtime.flags import flag_problem
from components.workers.config import EngineKind, WorkerConfig, engine_config_model

# The runtime's own rule for namespace and component names (components/runtime/runtime.py).
_MESH_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# A watcher is named ``<namespace>-<group>-<replica>`` and logs to state/logs/<watcher>.log: a plain file name.
_GROUP_NAME = r"^[a-z0-9][a-z0-9_-]{0,47}$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Set by kvmesh for every component; a group's env may not override them (CUDA_VISIBLE_DEVICES: see the group's env).
RESERVED_ENV = frozenset({"KVMESH_ETCD_ENDPOINTS", "KVMESH_NATS_URL"})


def _strict(model: type[BaseModel]) -> ConfigDict:
    """The graph section's config: the component's own, but never frozen (paths are resolved after validation) and
    never open to unknown keys (a typo is an error, not a silently ignored option)."""
    return ConfigDict(**{**model.model_config, "extra": "forbid", "frozen": False})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _parse_endpoint(value: str, default_port: int) -> None:
    try:
        parse_host_port(value, default_port)
    except ConfigError as e:  # a FatalError, not a ValueError: pydantic would not report it as a field error
        raise ValueError(str(e)) from None


def _embedded_shorthand(v: Any, external_key: str) -> Any:
    if v == "embedded":
        return {"embedded": True}
    if isinstance(v, str):
        raise ValueError(f"expected 'embedded' or a mapping such as {{{external_key}: ...}}, got {v!r}")
    return v


def _not_here(data: Any, keys: Mapping[str, str]) -> Any:
    """Reject keys a section's component config has but the graph sets elsewhere, saying where."""
    if isinstance(data, Mapping):
        for key, where in keys.items():
            if key in data:
                raise ValueError(f"{key} is not set here: {where}")
    return data


class EtcdSpec(_Strict):
    """Where etcd is: ``embedded`` (kvmesh starts one on loopback) or ``{endpoints: [http://host:2379, ...]}``."""

    embedded: bool = Field(
        default=False,
        description="Start etcd on 127.0.0.1 for this deployment; its data lives under <state_dir>/<namespace>/etcd "
        "and is wiped at every start (instances registered by a previous run must not count as ready).",
    )
    port: int | None = Field(
        default=None, ge=1, le=65535, description="Client port of the embedded etcd; unset: a free port."
    )
    endpoints: list[str] = Field(default_factory=list, description="Client URLs of an external etcd cluster.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return _embedded_shorthand(v, "endpoints")

    @field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, v: list[str]) -> list[str]:
        for ep in v:
            _parse_endpoint(ep, 2379)
        return v

    @model_validator(mode="after")
    def _one_of(self) -> EtcdSpec:
        if self.embedded == bool(self.endpoints):
            raise ValueError("give exactly one of 'embedded' or endpoints: [http://host:2379, ...]")
        if self.port is not None and not self.embedded:
            raise ValueError("port applies to an embedded etcd only; an external one is named by its endpoints")
        return self


class NatsSpec(_Strict):
    """Where NATS is: ``embedded`` (kvmesh starts nats-server on loopback) or ``{url: nats://host:4222}``."""

    embedded: bool = Field(
        default=False,
        description="Start nats-server (with JetStream) on 127.0.0.1; its data lives under "
        "<state_dir>/<namespace>/nats and is wiped at every start.",
    )
    port: int | None = Field(
        default=None, ge=1, le=65535, description="Client port of the embedded nats-server; unset: a free port."
    )
    url: str | None = Field(default=None, description="URL of an external NATS server, nats://host:4222.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return _embedded_shorthand(v, "url")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is not None:
            _parse_endpoint(v, 4222)
        return v

    @model_validator(mode="after")
    def _one_of(self) -> NatsSpec:
        if self.embedded == (self.url is not None):
            raise ValueError("give exactly one of 'embedded' or url: nats://host:4222")
        if self.port is not None and not self.embedded:
            raise ValueError("port applies to an embedded nats-server only; an external one is named by its url")
        return self


class InfrastructureSpec(_Strict):
    """etcd (discovery) and NATS (request and event planes) for this deployment."""

    etcd: EtcdSpec = Field(default_factory=lambda: EtcdSpec(embedded=True), description="Where etcd is.")
    nats: NatsSpec = Field(default_factory=lambda: NatsSpec(embedded=True), description="Where NATS is.")


# ---------------------------------------------------------------------------------------------------------------------
# Sections derived from the component configs: a field added to a component's config is a graph field at once.

_SET_BY_GRAPH = "the graph's top-level namespace is every component's"
_SET_BY_INFRA = "every component gets the endpoints of the infrastructure section"
_NAMESPACE_ELSEWHERE = {"namespace": _SET_BY_GRAPH}
_ENDPOINTS_ELSEWHERE = {"etcd_endpoints": _SET_BY_INFRA, "nats_url": _SET_BY_INFRA}


class RuntimeSpec(RuntimeConfig):
    """Settings of every process's runtime (``RuntimeConfig``: lease TTL, request-plane timing, response transport),
    given to each component as flags. etcd and NATS endpoints come from ``infrastructure``."""

    model_config = _strict(RuntimeConfig)

    @model_validator(mode="before")
    @classmethod
    def _endpoints_elsewhere(cls, data: Any) -> Any:
        return _not_here(data, _ENDPOINTS_ELSEWHERE)


class FrontendSpec(FrontendConfig):
    """The OpenAI-compatible frontend: every ``FrontendConfig`` field (``kvmesh frontend --help``), plus how the
    deployment runs it."""

    model_config = _strict(FrontendConfig)

    enabled: bool = Field(
        default=True,
        description="Run a frontend. false: workers only, e.g. a second graph that adds workers to another "
        "deployment's etcd and NATS (given as external endpoints).",
    )
    graceful_timeout_s: float = Field(
        default=40.0,
        gt=0,
        description="After SIGTERM, how long the frontend may run before it is killed; above the frontend's own "
        "shutdown_timeout_s (30 s by default) for requests in flight.",
    )

    @model_validator(mode="before")
    @classmethod
    def _namespace_elsewhere(cls, data: Any) -> Any:
        return _not_here(data, _NAMESPACE_ELSEWHERE)

    def component_values(self) -> dict[str, Any]:
        """The fields this section sets on ``kvmesh frontend``: those given in the graph, as FrontendConfig's."""
        return {k: getattr(self, k) for k in sorted(self.model_fields_set) if k in FrontendConfig.model_fields}


_PLANNER_ELSEWHERE = {
    "namespace": _SET_BY_GRAPH,
    "environment": "a graph's planner always drives the deployment's own circus arbiter (local)",
    "state_dir": "the planner uses kvmesh serve's own state directory",
    "k8s_namespace": "kvmesh k8s render sets it (--k8s-namespace) for the planner it runs on a cluster",
    "kubeconfig": "on a cluster the planner uses its pod's service account",
}


class PlannerSpec(PlannerConfig, SlaPlannerConfig, PlannerRunConfig):
    """The planner (``kvmesh planner --help``): every ``PlannerConfig``, ``SlaPlannerConfig`` and ``PlannerRunConfig``
    field but those the graph decides, plus how the deployment runs it. ``mode`` picks which planner's fields apply:
    one of the other mode is refused by name, and the chosen mode's defaults fill what is not given."""

    model_config = _strict(PlannerConfig)

    graceful_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="After SIGTERM, how long the planner may run before it is killed. It stops at once: a change in "
        "flight is abandoned, not undone (a worker it was adding finishes starting, one it was removing finishes "
        "draining and exits).",
    )

    @model_validator(mode="before")
    @classmethod
    def _set_elsewhere(cls, data: Any) -> Any:
        return _not_here(data, _PLANNER_ELSEWHERE)

    @model_validator(mode="after")
    def _one_mode(self) -> PlannerSpec:
        # Validated as `kvmesh planner` will: the given fields against the chosen mode's model alone (its defaults,
        # its checks), so that a graph the planner would refuse is refused at `kvmesh serve`, not in its log.
        policy = set(PlannerConfig.model_fields) | set(SlaPlannerConfig.model_fields)
        policy_config(self.mode, {k: getattr(self, k) for k in self.model_fields_set if k in policy})
        return self

    def component_values(self) -> dict[str, Any]:
        """The ``kvmesh planner`` options this section sets: those given, and always the model (its default, when the
        graph serves a single model, is filled in after validation)."""
        fields = (
            set(PlannerConfig.model_fields) | set(SlaPlannerConfig.model_fields) | set(PlannerRunConfig.model_fields)
        )
        own = fields - set(_PLANNER_ELSEWHERE)
        keys = (self.model_fields_set | {"served_model_name"}) & own
        return {k: getattr(self, k) for k in sorted(keys)}


_RESCHEDULER_ELSEWHERE = {
    "namespace": _SET_BY_GRAPH,
    "state_dir": "the rescheduler uses kvmesh serve's own state directory",
}
# Where a rescheduler runs: the graph decides it from the section itself (a watcher, or the frontend).
_RESCHEDULER_SWITCHES = {"enable_rescheduling", "colocated_rescheduling_mode"}


class ReschedulerSpec(ReschedulerConfig, ReschedulerRunConfig):
    """The rescheduler (``kvmesh rescheduler --help``): every ``ReschedulerConfig`` and ``ReschedulerRunConfig`` field
    but those the graph decides, plus how the deployment runs it (module docstring)."""

    model_config = _strict(ReschedulerConfig)

    enable_rescheduling: bool = Field(
        default=True,
        description="Run the rescheduler: the section's presence turns it on; false keeps the section and runs none.",
    )
    graceful_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="After SIGTERM, how long the rescheduler may run before it is killed. It stops at once: a "
        "migrate call in flight is closed, and the source's agent aborts a migration it had not committed.",
    )

    @model_validator(mode="before")
    @classmethod
    def _set_elsewhere(cls, data: Any) -> Any:
        return _not_here(data, _RESCHEDULER_ELSEWHERE)

    @property
    def runs(self) -> bool:
        return self.enable_rescheduling

    @property
    def colocated(self) -> bool:
        return self.enable_rescheduling and self.colocated_rescheduling_mode

    def component_values(self) -> dict[str, Any]:
        """The ``kvmesh rescheduler`` options this section sets: those given."""
        own = (set(ReschedulerConfig.model_fields) | set(ReschedulerRunConfig.model_fields)) - set(
            _RESCHEDULER_ELSEWHERE
        )
        return {k: getattr(self, k) for k in sorted((self.model_fields_set & own) - _RESCHEDULER_SWITCHES)}

    def colocated_values(self) -> dict[str, Any]:
        """The ``kvmesh frontend`` options that run this section's rescheduler inside the frontend: both switches
        and the policy fields given."""
        given = {k: getattr(self, k) for k in sorted(self.model_fields_set & set(ReschedulerConfig.model_fields))}
        return given | {"enable_rescheduling": True, "colocated_rescheduling_mode": True}


class _GroupFields(BaseModel):
    """What a worker group adds to the worker's and its engine's configs: how many processes, GPUs, environment.
    (What a graph asks more of the worker's own fields than ``kvmesh worker`` does is in ``_TIGHTENED``.)"""

    name: str = Field(
        pattern=_GROUP_NAME,
        description="Group name: lower-case letters, digits, '_' and '-'; names the watchers <namespace>-<name>-<i> "
        "and their logs state/logs/<namespace>-<name>-<i>.log.",
    )
    replicas: int = Field(default=1, ge=0, le=1024, description="Worker processes (circus watchers) in this group.")
    gpus_per_replica: int = Field(
        default=0,
        ge=0,
        le=64,
        description="GPUs given to each replica through CUDA_VISIBLE_DEVICES, consecutive in nvidia-smi order "
        "(or in the order of the CUDA_VISIBLE_DEVICES kvmesh serve itself runs with). 0: none (mock, or vLLM on CPU).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables of each replica. KVMESH_ETCD_ENDPOINTS and KVMESH_NATS_URL are set "
        "by kvmesh, and CUDA_VISIBLE_DEVICES too when gpus_per_replica > 0.",
    )
    graceful_timeout_s: float = Field(
        default=75.0,
        gt=0,
        description="After SIGTERM, how long a replica may drain before it is killed; keep it above the worker's "
        "drain_timeout_s (default 60 s) so a drain that runs out its time still ends cleanly.",
    )

    @model_validator(mode="before")
    @classmethod
    def _namespace_elsewhere(cls, data: Any) -> Any:
        return _not_here(data, _NAMESPACE_ELSEWHERE)

    @field_validator("env", mode="before")
    @classmethod
    def _stringify_env(cls, v: Any) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as an int; an environment only holds strings. A boolean is left alone, so
        # it fails as "not a string" at its own key: "true" or "1"? The graph must say.
        if not isinstance(v, Mapping):
            return v
        return {k: str(x) if isinstance(x, int | float) and not isinstance(x, bool) else x for k, x in v.items()}

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV_NAME.match(k):
                raise ValueError(f"{k!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if k in RESERVED_ENV:
                raise ValueError(f"{k} is set by kvmesh from the infrastructure section; remove it")
        return v

    @model_validator(mode="after")
    def _check_group(self) -> _GroupFields:
        if self.gpus_per_replica and "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError("env sets CUDA_VISIBLE_DEVICES, but kvmesh assigns it when gpus_per_replica > 0")
        return self

    def watcher_names(self, namespace: str) -> list[str]:
        return [replica_watcher(namespace, self.name, i) for i in range(self.replicas)]

    def component_values(self) -> dict[str, Any]:
        """The ``kvmesh worker`` options this group sets: the worker's and its engine's fields, as given, plus the
        ones a group always names (engine, component, model, model_path, num_workers)."""
        own = set(WorkerConfig.model_fields) | set(engine_config_model(getattr(self, "engine")).model_fields)  # noqa: B009
        always = {"engine", "component", "model", "model_path", "num_workers"}
        return {k: getattr(self, k) for k in sorted((self.model_fields_set | always) & own) if k != "namespace"}


def _tightened(model: type[BaseModel], name: str, constraints: FieldInfo, required: bool) -> tuple[Any, FieldInfo]:
    """Field ``name`` of ``model`` (its type, description, default) with ``constraints`` on top: derived, so the
    component's own declaration stays the only one."""
    field = model.model_fields[name]
    overrides: dict[str, Any] = {"default": PydanticUndefined} if required else {}
    return field.annotation, FieldInfo.merge_field_infos(field, constraints, **overrides)


# WorkerConfig fields a graph asks more of than ``kvmesh worker`` does: a group names its model and tokenizer (a
# default "mock-model" served from nowhere is a mistake in a file, not a convenience), and its component must be a
# name the runtime accepts before any process starts, not when each replica crash-loops on it.
_TIGHTENED: dict[str, tuple[FieldInfo, bool]] = {
    "model": (Field(min_length=1), True),
    "model_path": (
        Field(
            min_length=1,
            description=f"{WorkerConfig.model_fields['model_path'].description} In a graph, relative paths resolve "
            "against its base directory.",
        ),
        True,
    ),
    "component": (Field(pattern=_MESH_NAME), False),
}


def _group_model(kind: EngineKind) -> type[BaseModel]:
    """A worker group of engine ``kind``: ``_GroupFields`` + ``WorkerConfig`` + the engine's config, one model."""
    engine_model = engine_config_model(kind)
    engine_field = WorkerConfig.model_fields["engine"]
    fields: dict[str, Any] = {
        # One value per model: the tag the graph's union picks this model by.
        "engine": (Literal[kind], Field(description=engine_field.description)),  # type: ignore[valid-type]
    }
    for name, (constraints, required) in _TIGHTENED.items():
        fields[name] = _tightened(WorkerConfig, name, constraints, required)
    model = create_model(  # type: ignore[call-overload]
        f"WorkerGroup{kind.value.capitalize()}",
        __base__=(_GroupFields, WorkerConfig, engine_model),
        __config__=None,
        **fields,
    )
    model.model_config = _strict(engine_model)
    model.model_rebuild(force=True)
    return model  # type: ignore[no-any-return]


def _validate_num_workers(group: Any) -> Any:
    if group.num_workers > 1 and group.engine != EngineKind.MOCK:
        raise ValueError(f"num_workers > 1 is for engine mock only; run {group.engine} workers as replicas")
    return group


def _engine_tag(v: Any) -> str | None:
    engine = v.get("engine") if isinstance(v, Mapping) else getattr(v, "engine", None)
    return None if engine is None else str(engine)


WORKER_GROUP_MODELS: dict[EngineKind, type[BaseModel]] = {kind: _group_model(kind) for kind in EngineKind}
if TYPE_CHECKING:

    class WorkerGroup(_GroupFields, WorkerConfig):  # what a type checker may rely on of any group
        engine: EngineKind  # type: ignore[assignment]

else:
    WorkerGroup = Annotated[
        Annotated[WORKER_GROUP_MODELS[EngineKind.MOCK], Tag(EngineKind.MOCK.value)]
        | Annotated[WORKER_GROUP_MODELS[EngineKind.VLLM], Tag(EngineKind.VLLM.value)],
        Discriminator(_engine_tag),
        AfterValidator(_validate_num_workers),
    ]
    """A worker group (``_GroupFields`` + ``WorkerConfig`` + the engine's config), picked by its ``engine``."""


def frontend_watcher(namespace: str) -> str:
    return f"{namespace}-frontend"


def planner_watcher(namespace: str) -> str:
    """Never a replica's name: those end in -<index>."""
    return f"{namespace}-planner"


def rescheduler_watcher(namespace: str) -> str:
    """Never a replica's name: those end in -<index>."""
    return f"{namespace}-rescheduler"


def replica_watcher(namespace: str, group: str, replica: int) -> str:
    """Watchers (and so log files) carry the namespace: two deployments can share a state directory."""
    return f"{namespace}-{group}-{replica}"


class Graph(_Strict):
    """A deployment: namespace, infrastructure, runtime settings, frontend and worker groups."""

    namespace: str = Field(
        pattern=_MESH_NAME,
        description="Namespace every component registers in; names the state file <state_dir>/<namespace>.json.",
    )
    base_dir: str | None = Field(
        default=None,
        description="Directory that relative paths resolve against, itself relative to the graph file's directory; "
        "unset: the parent of the graph file's directory (the repository root for graphs/*.yaml).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Python logging level of every component (their logs: state/logs/)."
    )
    infrastructure: InfrastructureSpec = Field(
        default_factory=InfrastructureSpec, description="etcd and NATS; both embedded unless said otherwise."
    )
    runtime: RuntimeSpec = Field(
        default_factory=RuntimeSpec, description="Runtime settings of every process (lease TTL, transport, ...)."
    )
    frontend: FrontendSpec = Field(default_factory=FrontendSpec, description="The OpenAI-compatible frontend.")
    workers: list[WorkerGroup] = Field(min_length=1, description="Worker groups, started in this order.")
    planner: PlannerSpec | None = Field(
        default=None,
        description="Scale the worker pools of one model on their load (kvmesh planner); absent: no planner.",
    )

    rescheduler: ReschedulerSpec | None = Field(
        default=None,
        description="Move running requests between workers by Llumnix's policies (kvmesh rescheduler, or inside the "
        "frontend with colocated_rescheduling_mode); absent: no rescheduler.",
    )

    @field_validator("planner", "rescheduler", mode="before")
    @classmethod
    def _empty_planner(cls, v: Any) -> Any:
        return {} if v is None else v  # `planner:` with nothing under it: a planner with its defaults

    @field_validator("frontend", "runtime", mode="before")
    @classmethod
    def _empty_section(cls, v: Any) -> Any:
        return {} if v is None else v  # `frontend:` with nothing under it means the defaults

    @model_validator(mode="after")
    def _unique_groups(self) -> Graph:
        seen: set[str] = set()
        for g in self.workers:
            if g.name in seen:
                raise ValueError(f"two worker groups are named {g.name!r}; names must be unique (they name watchers)")
            seen.add(g.name)
        return self

    def group(self, name: str) -> Any:
        for g in self.workers:
            if g.name == name:
                return g
        raise KeyError(f"no worker group {name!r} in namespace {self.namespace!r}")

    def watcher_names(self) -> list[str]:
        front = [frontend_watcher(self.namespace)] if self.frontend.enabled else []
        planner = [planner_watcher(self.namespace)] if self.planner is not None else []
        resched = [rescheduler_watcher(self.namespace)] if self.rescheduler_watcher_runs() else []
        return front + [w for g in self.workers for w in g.watcher_names(self.namespace)] + planner + resched

    def rescheduler_watcher_runs(self) -> bool:
        """A ``kvmesh rescheduler`` watcher runs (a section that is on and not colocated in the frontend)."""
        r = self.rescheduler
        return r is not None and r.runs and not r.colocated

    def num_workers_expected(self) -> int:
        return sum(g.replicas * g.num_workers for g in self.workers)


# What the graph schema before this one called things, for a clear error instead of "unknown field".
OLD_SCHEMA = {
    ("frontend", "router"): "renamed router_policy (the frontend's own flag name): write router_policy: {value}",
    ("frontend", "args"): "the frontend's options are written directly in the frontend section now: {value}",
    ("workers", "engine_args"): "the worker's and engine's options are written directly in the group now: {value}",
}


def _old_schema_problems(data: Mapping[str, Any]) -> list[tuple[Loc, str]]:
    def flat(v: Any) -> str:
        if isinstance(v, Mapping):
            # The old args/engine_args took flag spellings too (max-retries, --max-retries): show the field names.
            items = [f"{str(k).lstrip('-').replace('-', '_')}: {x}" for k, x in v.items()]
            return ", ".join(items) or "(nothing to move)"
        return str(v)

    out: list[tuple[Loc, str]] = []
    fe = data.get("frontend")
    if isinstance(fe, Mapping):
        for key in ("router", "args"):
            if key in fe:
                out.append((("frontend", key), OLD_SCHEMA[("frontend", key)].format(value=flat(fe[key]))))
    groups = data.get("workers")
    if isinstance(groups, list):
        for i, g in enumerate(groups):
            if isinstance(g, Mapping) and "engine_args" in g:
                msg = OLD_SCHEMA[("workers", "engine_args")].format(value=flat(g["engine_args"]))
                out.append((("workers", i, "engine_args"), msg))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Loading


Loc = tuple[str | int, ...]


def load_graph(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Graph:
    """Read, override, validate and resolve a graph file; ``GraphError`` lists every problem found."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise GraphError(path, [GraphProblem("", f"cannot read the file: {e.strerror or e}")]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        col = f" (column {mark.column + 1})" if mark else ""
        what = e.problem or "does not parse"
        if e.context and e.context_mark:
            what += f", {e.context} that starts on line {e.context_mark.line + 1}"
        raise GraphError(path, [GraphProblem("", f"YAML syntax error{col}: {what}", line)]) from None
    except yaml.YAMLError as e:
        raise GraphError(path, [GraphProblem("", f"YAML error: {e}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise GraphError(path, [GraphProblem("", f"a graph is a mapping of fields, got {type(data).__name__}", 1)])
    lines = _line_map(node)
    data, overridden = apply_overrides(data, overrides)
    return validate_graph(data, path, lines, overridden)


def validate_graph(
    data: dict[str, Any],
    path: Path,
    lines: Mapping[Loc, int] | None = None,
    overridden: Iterable[Loc] = (),
) -> Graph:
    """Validate parsed data as the graph file ``path``; resolve relative paths against its base directory."""
    lines = lines or {}
    overridden = set(overridden)

    def problem(loc: Loc, message: str) -> GraphProblem:
        # From --set: at or under an override; or a section's own error (a validator across its fields) when the
        # section is not in the file at all and overrides created it.
        from_set = any(loc[: len(o)] == o for o in overridden) or (
            bool(loc) and loc not in lines and any(o[: len(loc)] == loc for o in overridden)
        )
        return GraphProblem(_render_loc(loc), message, None if from_set else _line_of(lines, loc), _origin(from_set))

    old = _old_schema_problems(data)
    if old:
        raise GraphError(path, [problem(loc, msg) for loc, msg in old])
    try:
        graph = Graph.model_validate(data)
    except ValidationError as e:
        raise GraphError(path, [problem(*_explain(err)) for err in e.errors()]) from None

    base = _base_dir(path, graph.base_dir)
    problems = [problem(loc, msg) for loc, msg in _semantic_problems(graph, base)]
    if problems:
        raise GraphError(path, problems)
    for g in graph.workers:
        g.model_path = str((base / g.model_path).resolve())
    if graph.planner is not None and graph.planner.log_dir:
        graph.planner.log_dir = str((base / graph.planner.log_dir).resolve())
    return graph


def _origin(from_set: bool) -> str:
    return "--set" if from_set else ""


def graph_base_dir(path: str | os.PathLike[str], graph: Graph) -> Path:
    """The directory ``graph``'s relative paths resolved against (the graph file at ``path``)."""
    return _base_dir(Path(path), graph.base_dir)


def _base_dir(path: Path, base_dir: str | None) -> Path:
    graph_dir = path.resolve().parent
    return (graph_dir / base_dir).resolve() if base_dir is not None else graph_dir.parent


def _semantic_problems(graph: Graph, base: Path) -> list[tuple[Loc, str]]:
    """What a field validator cannot see: files on disk, groups that serve one model in roles that do not fit
    together (``_role_problems``), and a value (a null, a list item with a comma) that no flag can carry to the
    component."""
    out: list[tuple[Loc, str]] = []
    if graph.base_dir is not None and not base.is_dir():
        out.append((("base_dir",), f"{base} is not a directory"))
    sections: list[tuple[Loc, BaseModel, dict[str, Any]]] = [
        (("runtime",), graph.runtime, {k: getattr(graph.runtime, k) for k in graph.runtime.model_fields_set}),
        (("frontend",), graph.frontend, graph.frontend.component_values()),
    ]
    for i, g in enumerate(graph.workers):
        model_dir = base / g.model_path
        if not model_dir.is_dir():
            out.append((("workers", i, "model_path"), f"{model_dir} is not a directory (relative to {base})"))
        sections.append((("workers", i), g, g.component_values()))
    out += _role_problems(graph)
    if graph.planner is not None:
        out += _planner_problems(graph)
        sections.append((("planner",), graph.planner, graph.planner.component_values()))
    if graph.rescheduler is not None:
        out += _rescheduler_problems(graph)
        sections.append((("rescheduler",), graph.rescheduler, graph.rescheduler.component_values()))
    for loc, section, values in sections:
        for key, value in values.items():
            if value is None and type(section).model_fields[key].get_default(call_default_factory=True) is not None:
                out.append(((*loc, key), "null cannot be passed to the component; leave it out for its default"))
            elif (why := flag_problem(key, value)) is not None:
                out.append(((*loc, key), why.removeprefix(f"{key}: ")))
    return out


def _rescheduler_problems(graph: Graph) -> list[tuple[Loc, str]]:
    """A colocated rescheduler runs in the graph's one frontend process, and takes no field of the standalone's."""
    r = graph.rescheduler
    assert r is not None
    if not r.colocated:
        return []
    loc: Loc = ("rescheduler", "colocated_rescheduling_mode")
    out: list[tuple[Loc, str]] = []
    if not graph.frontend.enabled:
        out.append((loc, "the rescheduler runs inside the frontend, and this graph runs none (frontend.enabled)"))
    elif graph.frontend.replicas != 1:
        n = "its default (one per two cores)" if graph.frontend.replicas is None else str(graph.frontend.replicas)
        out.append(
            (
                loc,
                f"the rescheduler runs inside one frontend process; frontend.replicas is {n}: set frontend.replicas: "
                "1, or leave colocated_rescheduling_mode out for a rescheduler watcher of its own",
            )
        )
    for key in sorted(r.model_fields_set & set(ReschedulerRunConfig.model_fields)):
        out.append(
            (
                ("rescheduler", key),
                "a colocated rescheduler does not take it (it calls the backend workers and "
                "serves its metrics on a free loopback port)",
            )
        )
    return out


def _planner_problems(graph: Graph) -> list[tuple[Loc, str]]:
    """The planner scales one model that this graph serves; left out, it is the graph's only model (filled in here)."""
    assert graph.planner is not None
    models = list(dict.fromkeys(g.model for g in graph.workers))
    if "served_model_name" not in graph.planner.model_fields_set:
        if len(models) == 1:
            graph.planner.served_model_name = models[0]
            return []
        return [
            (
                ("planner", "served_model_name"),
                f"required: this graph serves {len(models)} models ({', '.join(models)}); say which one the planner "
                "scales",
            )
        ]
    if graph.planner.served_model_name not in models:
        return [
            (
                ("planner", "served_model_name"),
                f"{graph.planner.served_model_name!r} is served by no worker group of this graph (models: "
                f"{', '.join(models)})",
            )
        ]
    return []


def _role_problems(graph: Graph) -> list[tuple[Loc, str]]:
    """How a graph serves each model must be whole: aggregated, or disaggregated with both prefill and decode
    workers. Each problem is reported once, at the role of the first group it concerns, naming every group.

    - Decode workers without prefill workers would prefill everything themselves, as aggregated workers with extra
      steps; prefill workers without decode workers idle, since clients are never routed to them and only decode
      workers enqueue prompts. Both are a missing group, most likely a typo in a ``model`` or a ``role``.
      Not checked when the graph runs no frontend: such a graph adds workers to another deployment (``frontend.
      enabled``), whose groups it cannot see, so adding prefill workers alone is legitimate there.
    - Aggregated and decode workers of one model are refused rather than allowed. The router places a request on any
      routable worker of the model, so whether it is disaggregated would be chance; the kv policy compares workers
      by one step-time model, which a decode worker (whose long prompts cost it a queue hop and a transfer, not a
      prefill) does not follow; and the planner scales prefill and decode workers on the queue and on KV use, which
      leaves an aggregated group in between scaled by neither. Two models (or two graphs) serve both ways side by
      side. A refusal can be relaxed later without breaking a graph; an acceptance could not be withdrawn.
    """
    by_model: dict[str, dict[WorkerRole, list[int]]] = {}
    for i, g in enumerate(graph.workers):
        by_model.setdefault(g.model, {}).setdefault(g.role, []).append(i)

    def groups(indices: list[int]) -> str:
        names = ", ".join(repr(graph.workers[i].name) for i in indices)
        return f"group {names}" if len(indices) == 1 else f"groups {names}"

    out: list[tuple[Loc, str]] = []
    for model, roles in by_model.items():
        agg = roles.get(WorkerRole.AGGREGATED, [])
        prefill = roles.get(WorkerRole.PREFILL, [])
        decode = roles.get(WorkerRole.DECODE, [])
        if agg and decode:
            out.append(
                (
                    ("workers", decode[0], "role"),
                    f"model {model!r} has aggregated ({groups(agg)}) and decode ({groups(decode)}) workers: serve a "
                    "model one way, aggregated or disaggregated (prefill + decode groups); serve the other way "
                    "under another model name or in another graph",
                )
            )
        if not graph.frontend.enabled:
            continue
        if decode and not prefill:
            out.append(
                (
                    ("workers", decode[0], "role"),
                    f"model {model!r} has decode workers ({groups(decode)}) but no prefill workers to prefill its "
                    f"long prompts: add a group with role: prefill and model: {model}, or make these aggregated",
                )
            )
        if prefill and not decode:
            out.append(
                (
                    ("workers", prefill[0], "role"),
                    f"model {model!r} has prefill workers ({groups(prefill)}) but no decode workers: clients are "
                    "never routed to prefill workers and only decode workers send them prompts; add a group with "
                    f"role: decode and model: {model}",
                )
            )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Overrides: --set PATH=VALUE


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[Loc]]:
    """Apply ``frontend.port=0`` / ``workers[0].replicas=1`` / ``workers.0.speedup_ratio=inf``.

    VALUE is read as YAML (``0`` is a number, ``true`` a boolean, ``[a, b]`` a list, ``''`` an empty string).
    Returns the new data and the paths that were set, so problems there are reported as coming from --set.
    """
    import copy

    data = copy.deepcopy(data)
    done: list[Loc] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise OverrideError(item, "expected PATH=VALUE, e.g. frontend.port=0")
        loc = _parse_path(item, key.strip())
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise OverrideError(item, f"the value does not parse as YAML: {e}") from None
        target: Any = data
        for depth, part in enumerate(loc[:-1]):
            target = _descend(item, target, part, loc[: depth + 1], create=True)
        last = loc[-1]
        if isinstance(target, list):
            if not isinstance(last, int) or not 0 <= last < len(target):
                raise OverrideError(item, f"{_render_loc(loc[:-1])} has {len(target)} entries")
            target[last] = value
        elif isinstance(target, dict):
            target[str(last)] = value
        else:
            raise OverrideError(item, f"{_render_loc(loc[:-1])} is a {type(target).__name__}, not a mapping")
        done.append(loc)
    return data, done


_PATH_RE = re.compile(r"^[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+|\[\d+\])*$")


def _parse_path(item: str, key: str) -> Loc:
    if not _PATH_RE.match(key):
        raise OverrideError(item, "PATH is field names joined by '.', with [i] or .i for list entries")
    return tuple(int(t.strip("[]")) if t.strip("[]").isdigit() else t for t in re.findall(r"[^.\[\]]+|\[\d+\]", key))


def _descend(item: str, target: Any, part: str | int, loc: Loc, create: bool) -> Any:
    if isinstance(target, list):
        if not isinstance(part, int) or not 0 <= part < len(target):
            raise OverrideError(item, f"{_render_loc(loc[:-1])} has {len(target)} entries")
        return target[part]
    if isinstance(target, dict):
        key = str(part)
        if key not in target or target[key] is None:
            if not create:
                raise OverrideError(item, f"{_render_loc(loc)} does not exist")
            target[key] = {}
        elif target[key] == "embedded":  # `etcd: embedded` shorthand, then --set infrastructure.etcd.port=2379
            target[key] = {"embedded": True}
        return target[key]
    raise OverrideError(item, f"{_render_loc(loc[:-1])} is a {type(target).__name__}, not a mapping")


# ---------------------------------------------------------------------------------------------------------------------
# Error messages: field paths, lines, what is allowed


def _render_loc(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_map(node: yaml.Node | None) -> dict[Loc, int]:
    """1-based line of every key and list entry in the document, by its path."""
    lines: dict[Loc, int] = {}

    def walk(n: yaml.Node, loc: Loc) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
                lines[(*loc, key)] = k.start_mark.line + 1
                walk(v, (*loc, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[(*loc, i)] = v.start_mark.line + 1
                walk(v, (*loc, i))

    if node is not None:
        lines[()] = node.start_mark.line + 1
        walk(node, ())
    return lines


def _line_of(lines: Mapping[Loc, int], loc: Loc) -> int | None:
    """The line of ``loc``, or of its nearest ancestor present in the file (a missing field: its parent's line)."""
    for n in range(len(loc), -1, -1):
        if (line := lines.get(loc[:n])) is not None:
            return line
    return None


def _model_at(root: type[BaseModel], loc: Loc, engine: str | None = None) -> type[BaseModel] | None:
    """The model class whose field ``loc`` would be (to list the allowed fields of an unknown one); ``engine`` picks
    the worker group's model."""
    current: Any = root
    for i, part in enumerate(loc):
        if isinstance(part, int):
            continue  # a list index: the element type was already unwrapped
        if current is Graph and part == "workers":
            if engine not in {k.value for k in EngineKind}:
                return None
            if len(loc) == i + 1 or (len(loc) == i + 2 and isinstance(loc[i + 1], int)):
                return WORKER_GROUP_MODELS[EngineKind(engine)]
            current = WORKER_GROUP_MODELS[EngineKind(engine)]
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _unwrap(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _settable(model: type[BaseModel]) -> list[str]:
    """The fields a graph may write in a section of ``model``: a worker group's own first, then the worker's, then
    its engine's; never those the graph sets elsewhere (namespace, endpoints)."""
    elsewhere: Mapping[str, str] = {}
    if issubclass(model, RuntimeSpec):
        elsewhere = _ENDPOINTS_ELSEWHERE
    elif issubclass(model, FrontendSpec | _GroupFields):
        elsewhere = _NAMESPACE_ELSEWHERE
    elif issubclass(model, PlannerSpec):
        elsewhere = _PLANNER_ELSEWHERE
    elif issubclass(model, ReschedulerSpec):
        elsewhere = _RESCHEDULER_ELSEWHERE
    names = [n for n in model.model_fields if n not in elsewhere]
    if issubclass(model, _GroupFields):
        rank = {n: i for i, n in enumerate([*_GroupFields.model_fields, *WorkerConfig.model_fields])}
        names.sort(key=lambda n: rank.get(n, len(rank)))  # stable: the engine's fields keep their order
    return names


def _guess(key: str, allowed: Sequence[str]) -> str | None:
    """The field an unknown key most likely meant: its flag spelling (block-size), the one field it begins (speedup:
    speedup_ratio, lease_ttl: lease_ttl_s), else a close spelling (replicaz). None rather than a far guess."""
    key = key.lstrip("-").replace("-", "_")
    if key in allowed:
        return key
    starting = [a for a in allowed if a.startswith(key)]
    if len(starting) == 1:
        return starting[0]
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    return close[0] if close else None


def _unwrap(annotation: Any) -> Any:
    origin = get_origin(annotation)
    if origin is list:
        return _unwrap(get_args(annotation)[0])
    if origin is not None:  # Optional[X] / X | None
        models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else annotation
    return annotation


_PATTERN_WORDS = {
    _MESH_NAME: "1-64 letters, digits, '_' or '-'",
    _GROUP_NAME: "1-48 lower-case letters, digits, '_' or '-', starting with a letter or digit",
    r"^[A-Za-z0-9_-]{1,64}$": "1-64 letters, digits, '_' or '-'",
}


def _explain(err: Mapping[str, Any], root: type[BaseModel] = Graph) -> tuple[Loc, str]:
    """A pydantic error as (location, message that says what is allowed and what was given)."""
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    engine = None
    if len(loc) >= 3 and loc[0] == "workers" and isinstance(loc[1], int) and isinstance(loc[2], str):
        if loc[2] in {k.value for k in EngineKind}:  # pydantic names the union member: not a field of the file
            engine, loc = loc[2], loc[:2] + loc[3:]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        engines = ", ".join(k.value for k in EngineKind)
        if kind == "union_tag_not_found":
            return (*loc, "engine"), f"required field is missing (the inference engine: {engines})"
        return (*loc, "engine"), f"must be one of {engines} (got {err.get('ctx', {}).get('tag')!r})"
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1], engine)
        allowed = _settable(parent) if parent else []
        guess = _guess(str(loc[-1]), allowed)
        hint = f"; did you mean {guess!r}?" if guess else ""
        return loc, f"unknown field {loc[-1]!r}{hint}; allowed here: {', '.join(allowed) or 'none'}"
    if kind == "missing":
        parent = _model_at(root, loc[:-1], engine)
        field = parent.model_fields.get(str(loc[-1])) if parent else None
        hint = f" ({field.description})" if field and field.description else ""
        return loc, f"required field is missing{hint}"
    given = err.get("input")
    if kind == "string_pattern_mismatch":
        pattern = str(err.get("ctx", {}).get("pattern"))
        msg = f"must be {_PATTERN_WORDS.get(pattern, 'a string matching ' + pattern)}"
    if kind == "string_type" and len(loc) >= 2 and loc[-2] == "env":
        msg += "; quote it: an environment holds strings"
    if isinstance(given, str | int | float | bool) and kind not in ("value_error", "assertion_error"):
        shown = "inf" if isinstance(given, float) and math.isinf(given) else repr(given)
        msg += f" (got {shown})"
    return loc, msg
