"""Graph files: the YAML that ``kvmesh serve`` runs. One pydantic schema (``Graph``) and its loader.

A graph names a namespace, where etcd and NATS are (``embedded``: kvmesh starts them on loopback, or external
endpoints), the frontend, and groups of workers::

    namespace: demo
    infrastructure: {etcd: embedded, nats: embedded}
    frontend: {port: 8000}
    workers:
      - {name: mock, engine: mock, model: tiny-llama, model_path: models/tiny-llama, replicas: 2, num_workers: 8}

Every model forbids unknown fields, so a typo is an error rather than a silently ignored key. ``load_graph`` turns
every problem into a ``GraphProblem`` that names the file, the line, the field path (``workers[0].replicas``) and
what is allowed; a YAML syntax error names its line and column.

Relative paths (``model_path``) resolve against the graph's *base directory*: the parent of the directory holding
the graph file, so ``graphs/x.yaml`` refers to ``models/tiny-llama`` as the repository does. A graph kept elsewhere
sets ``base_dir`` (itself relative to the graph file's own directory, e.g. ``base_dir: .``). ``--set`` overrides are
applied to the parsed YAML before validation, so their errors are reported like any other.

``engine_args`` are the flags of ``kvmesh worker`` beyond those the group itself sets: for ``engine: mock`` they are
checked here against ``MockEngineConfig`` and ``WorkerConfig`` (name and value); for ``engine: vllm`` only the
``WorkerConfig`` ones are checked and the rest are passed through to the vLLM adapter, which rejects what it does
not know when it starts.

Not in the schema yet: planner and rescheduler sections. They are added with their components; until then a graph
that has them is rejected as having an unknown field.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.deploy.errors import GraphError, GraphProblem, OverrideError
from components.runtime.config import parse_host_port
from components.runtime.errors import ConfigError
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.mock import MockEngineConfig

# The runtime's own rule for namespace and component names (components/runtime/runtime.py).
_MESH_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# A watcher is named ``<group>-<replica>`` and logs to state/logs/<watcher>.log: keep it a plain file name.
_GROUP_NAME = r"^[a-z0-9][a-z0-9_-]{0,47}$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

FRONTEND_WATCHER = "frontend"
# Flags of ``kvmesh worker`` that a worker group sets from its own fields; engine_args may not repeat them.
RESERVED_WORKER_ARGS = frozenset({"engine", "namespace", "component", "model", "model_path", "num_workers"})
# Flags of ``kvmesh frontend`` that the graph sets from the frontend section's own fields.
RESERVED_FRONTEND_ARGS = frozenset({"namespace", "host", "port", "api_key", "router", "router_policy"})
# Set by kvmesh for every component; a group's env may not override them (CUDA_VISIBLE_DEVICES: see WorkerGroup.env).
RESERVED_ENV = frozenset({"KVMESH_ETCD_ENDPOINTS", "KVMESH_NATS_URL"})


def _check_flag_values(v: dict[str, Any]) -> dict[str, Any]:
    scalar = bool | int | float | str
    for k, val in v.items():
        if val is not None and not isinstance(val, scalar):
            if not (isinstance(val, list) and all(isinstance(x, scalar) for x in val)):
                raise ValueError(f"{k}: a flag value is a number, a string, a boolean or a list of those")
    return v


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


class FrontendSpec(_Strict):
    """The OpenAI-compatible HTTP frontend (``kvmesh frontend``), one process."""

    enabled: bool = Field(
        default=True,
        description="Run a frontend. false: workers only, e.g. a second graph that adds workers to another "
        "deployment's etcd and NATS (given as external endpoints).",
    )
    host: str = Field(default="127.0.0.1", description="Address to bind; 127.0.0.1 keeps it local, 0.0.0.0 exposes it.")
    port: int = Field(
        default=8000, ge=0, le=65535, description="Port to listen on (vLLM's and Dynamo's default); 0: a free port."
    )
    api_key: str | None = Field(
        default=None,
        description="If set, every request must carry 'Authorization: Bearer <api_key>'. Set it for any exposed host.",
    )
    router: str = Field(
        default="round_robin",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="Routing policy, by its registered name (the frontend's --router-policy).",
    )
    graceful_timeout_s: float = Field(
        default=40.0,
        gt=0,
        description="After SIGTERM, how long the frontend may run before it is killed; above the frontend's own "
        "shutdown_timeout_s (30 s by default) for requests in flight.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further flags of 'kvmesh frontend', by field name (max_retries: 5 -> --max-retries 5).",
    )

    _check_args = field_validator("args")(_check_flag_values)


class WorkerGroup(_Strict):
    """Identical worker processes: ``replicas`` watchers named ``<name>-0`` .. ``<name>-<replicas-1>``."""

    name: str = Field(
        pattern=_GROUP_NAME,
        description="Group name: lower-case letters, digits, '_' and '-'; names the watchers <name>-<i> and their "
        "logs state/logs/<name>-<i>.log.",
    )
    engine: EngineKind = Field(description="Inference engine: mock (simulated, no GPU) or vllm.")
    component: str = Field(default="backend", pattern=_MESH_NAME, description="Component the workers register under.")
    model: str = Field(min_length=1, description="Served model name, as clients ask for it.")
    model_path: str = Field(
        min_length=1,
        description="Local model directory (config and tokenizer); relative paths resolve against the base directory.",
    )
    replicas: int = Field(default=1, ge=0, le=1024, description="Worker processes (circus watchers) in this group.")
    gpus_per_replica: int = Field(
        default=0,
        ge=0,
        le=64,
        description="GPUs given to each replica through CUDA_VISIBLE_DEVICES, consecutive in nvidia-smi order "
        "(or in the order of the CUDA_VISIBLE_DEVICES kvmesh serve itself runs with). 0: none (mock, or vLLM on CPU).",
    )
    num_workers: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Workers inside each replica's process, each with its own instance id and lease; mock only.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further flags of 'kvmesh worker', by field name (speedup_ratio: 10 -> --speedup-ratio 10; "
        "true/false -> --flag/--no-flag; a list -> comma-separated).",
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

    _check_engine_args = field_validator("engine_args")(_check_flag_values)

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
    def _check_group(self) -> WorkerGroup:
        if self.num_workers > 1 and self.engine != EngineKind.MOCK:
            raise ValueError(f"num_workers > 1 is for engine mock only; run {self.engine} workers as replicas")
        if self.gpus_per_replica and "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError("env sets CUDA_VISIBLE_DEVICES, but kvmesh assigns it when gpus_per_replica > 0")
        return self

    def watcher_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.replicas)]


class Graph(_Strict):
    """A deployment: namespace, infrastructure, frontend and worker groups."""

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
    frontend: FrontendSpec = Field(default_factory=FrontendSpec, description="The OpenAI-compatible frontend.")
    workers: list[WorkerGroup] = Field(min_length=1, description="Worker groups, started in this order.")

    @field_validator("frontend", mode="before")
    @classmethod
    def _empty_frontend(cls, v: Any) -> Any:
        return {} if v is None else v  # `frontend:` with nothing under it means the defaults

    @model_validator(mode="after")
    def _unique_groups(self) -> Graph:
        seen: set[str] = set()
        for g in self.workers:
            if g.name in seen:
                raise ValueError(f"two worker groups are named {g.name!r}; names must be unique (they name watchers)")
            seen.add(g.name)
        return self

    def watcher_names(self) -> list[str]:
        front = [FRONTEND_WATCHER] if self.frontend.enabled else []
        return front + [w for g in self.workers for w in g.watcher_names()]

    def num_workers_expected(self) -> int:
        return sum(g.replicas * g.num_workers for g in self.workers)


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
        from_set = any(loc[: len(o)] == o for o in overridden)
        return GraphProblem(_render_loc(loc), message, None if from_set else _line_of(lines, loc), _origin(from_set))

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
    return graph


def _origin(from_set: bool) -> str:
    return "--set" if from_set else ""


def _base_dir(path: Path, base_dir: str | None) -> Path:
    graph_dir = path.resolve().parent
    return (graph_dir / base_dir).resolve() if base_dir is not None else graph_dir.parent


def _semantic_problems(graph: Graph, base: Path) -> list[tuple[Loc, str]]:
    """What a field validator cannot see: files on disk, and flags checked against the configs they become."""
    out: list[tuple[Loc, str]] = []
    if graph.base_dir is not None and not base.is_dir():
        out.append((("base_dir",), f"{base} is not a directory"))
    if graph.frontend.enabled:
        fe_config = _optional_config("components.frontend.config", "FrontendConfig")
        fe_models = [fe_config] if fe_config else []
        problems = flag_problems(
            graph.frontend.args, fe_models, RESERVED_FRONTEND_ARGS, "the frontend section", complete=bool(fe_models)
        )
        out += [(("frontend", "args", *loc), msg) for loc, msg in problems]
    for i, g in enumerate(graph.workers):
        model_dir = base / g.model_path
        if not model_dir.is_dir():
            out.append((("workers", i, "model_path"), f"{model_dir} is not a directory (relative to {base})"))
        models, complete = engine_arg_models(g.engine)
        problems = flag_problems(g.engine_args, models, RESERVED_WORKER_ARGS, "the worker group", complete=complete)
        out += [(("workers", i, "engine_args", *loc), msg) for loc, msg in problems]
    return out


def _optional_config(module: str, name: str) -> type[BaseModel] | None:
    """A component's config model, if that component is installed (its flags are checked against it)."""
    import importlib

    try:
        model = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def engine_arg_models(engine: EngineKind) -> tuple[list[type[BaseModel]], bool]:
    """The config models a worker's flags feed (WorkerConfig and the engine's own), and whether they are all of them.

    An engine whose config module is absent from this build is left to check its own flags when it starts: keys
    that WorkerConfig does not know are then passed through unchecked.
    """
    if engine == EngineKind.MOCK:
        return [WorkerConfig, MockEngineConfig], True
    vllm = _optional_config("components.workers.engines.vllm.config", "VllmEngineConfig")
    return ([WorkerConfig, vllm], True) if vllm else ([WorkerConfig], False)


def flag_problems(
    args: Mapping[str, Any],
    models: Sequence[type[BaseModel]],
    reserved: Iterable[str],
    owner: str,
    complete: bool = True,
) -> list[tuple[Loc, str]]:
    """Each reserved, unknown or invalid flag, located by its key: values are validated by the models that own
    them; unknown keys are an error only when ``models`` are ``complete`` (every flag the process takes)."""
    reserved = set(reserved)
    out: list[tuple[Loc, str]] = []
    fields = {name for m in models for name in m.model_fields} - reserved
    for key, value in args.items():
        if key in reserved:
            out.append(((key,), f"set by {owner}'s own fields, not here"))
        elif "-" in key:
            out.append(((key,), f"use the field name {key.replace('-', '_')!r}, not the flag spelling"))
        elif value is None:
            out.append(((key,), "null cannot be passed as a flag; leave the option out to keep its default"))
        elif complete and key not in fields:
            out.append(((key,), f"unknown option; allowed: {', '.join(sorted(fields))}"))
    for model in models:
        own = set(model.model_fields) - reserved
        given = {k: v for k, v in args.items() if k in own and v is not None}
        # Required fields the graph sets elsewhere (the vLLM config's model_path): a placeholder, checked elsewhere.
        filler = {n: "-" for n, f in model.model_fields.items() if f.is_required() and n not in given}
        try:
            model.model_validate(given | filler)
        except ValidationError as e:
            out += [_explain(err, model) for err in e.errors()]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Overrides: --set PATH=VALUE


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[Loc]]:
    """Apply ``frontend.port=0`` / ``workers[0].replicas=1`` / ``workers.0.engine_args.speedup_ratio=inf``.

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


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model class whose field ``loc`` would be (to list the allowed fields of an unknown one)."""
    current: Any = root
    for part in loc:
        if isinstance(part, int):
            continue  # a list index: the element type was already unwrapped
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _unwrap(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


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
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        allowed = ", ".join(parent.model_fields) if parent else "none"
        return loc, f"unknown field {loc[-1]!r}; allowed here: {allowed}"
    if kind == "missing":
        parent = _model_at(root, loc[:-1])
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
