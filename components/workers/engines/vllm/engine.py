"""``VllmEngine``: vLLM's V1 ``AsyncLLM`` behind kvmesh's ``Engine`` protocol.

What it owns, per engine:

* one ``AsyncLLM`` in this process (which spawns ``VLLM::EngineCore`` and ``VLLM::Worker`` processes; the CPU
  platform forces ``spawn``, so every entry point that can start an engine keeps its ``if __name__ == "__main__"``
  guard), fed token ids (``skip_tokenizer_init``) and streaming ``DELTA`` outputs;
* a stat logger that vLLM calls once per engine step, feeding ``VllmStats`` (KV usage, running, waiting,
  preemptions, batch size) for ``snapshot()``;
* a private temporary directory (0700) holding the ``ipc://`` sockets of vLLM's KV-event publisher and its replay
  socket, and one task, ``vllm-kv-events:<name>``, that subscribes to them and turns vLLM's events into kvmesh's
  (``convert.KvEventTranslator``) for ``kv_events()`` and ``kv_state()``.

Blocking calls stay off the event loop: ``import vllm`` (~3 s), ``AsyncLLM.from_engine_args`` (~10 s on 2 cores)
and ``AsyncLLM.shutdown`` (~4 s) run in threads, so a worker's lease keep-alives (every 3.3 s at the default 10 s TTL)
and its other engines go on meanwhile. vLLM's output handler is an asyncio task; when the engine is built in a
thread there is no running loop, so ``start()`` starts that task itself, back on the loop, before any request (vLLM
would otherwise start it lazily on the first request and could miss an early engine failure).

Errors: a prompt id outside the vocabulary, an empty prompt, bad sampling values, a prompt longer than
``max_model_len`` and a duplicate in-flight request id raise ``EngineRequestError`` (the engine keeps serving);
a dead engine core raises ``EngineDeadError``.

Shutdown on SIGTERM: the worker drains its requests, then ``shutdown()`` aborts what is left, stops the subscriber
and calls ``AsyncLLM.shutdown()``, which terminates the engine-core and model processes. A SIGKILL of the worker
cannot run any of that; vLLM's processes then die by their lifeline (hooks.py: a thread in each that ends it once
its parent is gone), and the private directory holding vLLM's ipc sockets (``VLLM_RPC_BASE_PATH``, one per worker
process, with the KV-event sockets inside) is removed by them, or at a normal exit by this process.

KV connector: ``start()`` decides ``remote_prefill_mode`` (``nixl.choose_remote_prefill_mode``, prefill and decode
workers) and ``migration_mode`` (``nixl.choose_migration_mode``, aggregated and decode workers) and, where either is
kv_transfer, builds the engine with kvmesh's NIXL connector in the role they need together (``nixl.connector_role``:
``kv_producer`` for a prefill worker, ``kv_consumer`` for a decode worker that only pulls prompts, ``kv_both`` for an
engine that migrates: a source and a target; one free handshake port each). If the engine does not start with it and
no mode required it, it starts again without, and both modes say recompute.

Disaggregated serving: ``prefill_handoff`` keeps a prompt's KV for a pull and ``generate_remote`` pulls it, or
recomputes (nixl.py).

Migration (components/migration/engine.py). ``suspend`` aborts the request in vLLM (its full blocks stay in the prefix
cache); the stream delivers what vLLM produced before, then a ``SuspendedChunk``. ``commit_migration`` on another
engine continues it as a *continuation* request: prompt plus the outputs so far, ``max_tokens`` less them, and for a
seeded request ``extra_args[SAMPLER_DRAWS_KEY]`` = the number of outputs, which hooks.py turns into the sampler draws
the earlier engine made, so greedy and seeded output are exactly the unmoved request's. ``resume`` continues it the
same way on this engine (its prefix cache holds nearly all of it). Two modes:

* **kv_transfer** (``migration_mode``, with the connector): vLLM exports nothing of an aborted request, so the
  suspended request's tokens are submitted again here with ``max_tokens=1`` and ``do_remote_decode``
  (``export_kv``/``export_tokens``: served from the prefix cache, at most the last partial block computed), and the
  final output's ``kv_transfer_params`` name the kept blocks; the destination's ``reserve_migration`` checks room
  beforehand, and its ``commit_migration`` submits the continuation with those params, so vLLM pulls the blocks it
  lacks and computes only the last token (a hand-off it cannot use, ``nixl.check_handoff``, is recomputed; a pull
  that fails too, by vLLM, and is counted in ``migrations_in.pull_failed``).
* **recompute**: the continuation carries no KV; the destination computes prompt + outputs again.

Imports vLLM lazily (in ``start()``), so importing this module costs nothing and the mock path never loads vLLM.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from components.migration.engine import KvExtent, SuspendedChunk
from components.migration.types import RequestTable, RequestView
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import (
    FinishReason,
    GenerateRequest,
    KvEvent,
    KvStateSnapshot,
    LoadSnapshot,
    RemotePrefillResult,
    TokenChunk,
)
from components.protocol.metadata import RemotePrefillMode, WorkerRole
from components.protocol.migration import MigratingRequest, MigrationMode

from ..base import EngineDeadError, EngineRequestError
from .config import (
    DROP_UTILITY,
    OWNER_PID_ENV,
    RUNTIME_DIR_ENV,
    SAMPLER_DRAWS_KEY,
    VllmEngineConfig,
    apply_vllm_environment,
    engine_arguments,
)
from .convert import (
    DuplicateRequestError,
    KvEventTranslator,
    RequestProgress,
    VllmStats,
    decode_kv_event_batch,
    finish_reason,
    load_snapshot,
    sampling_kwargs,
    validate_prompt,
)
from .nixl import (
    SOURCE_PARAMS,
    UCX_ENVIRONMENT,
    check_handoff,
    choose_migration_mode,
    choose_remote_prefill_mode,
    connector_role,
    free_loopback_port,
    kv_transfer_config,
    nixl_unavailable_reason,
)

__all__ = ["VllmEngine"]

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv"


@dataclasses.dataclass(frozen=True, slots=True)
class _Vllm:
    """The vLLM names the adapter uses, imported once (``_import_vllm``)."""

    AsyncEngineArgs: Any
    AsyncLLM: Any
    SamplingParams: Any
    RequestOutputKind: Any
    KVEventsConfig: Any
    KVTransferConfig: Any
    StatLoggerBase: Any  # what the adapter's stat logger extends (``_stat_logger_class``)
    tokens_input: Callable[[list[int]], Any]
    EngineDeadError: type[BaseException]
    EngineGenerateError: type[BaseException]
    ClientError: type[BaseException]  # VLLMClientError: bad request (validation, admission)


def _import_vllm() -> _Vllm:
    import vllm.exceptions
    import vllm.inputs
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
    from vllm.v1.engine.exceptions import EngineGenerateError
    from vllm.v1.metrics import loggers

    # Older vLLM raised ValueError for bad requests (before VLLMClientError) and took a TokensPrompt dict (0.32
    # still does, with a deprecation warning); GPU deployments may run another version than the CPU tests.
    client_error: type[BaseException] = getattr(vllm.exceptions, "VLLMClientError", ValueError)
    tokens_input: Callable[[list[int]], Any] = getattr(
        vllm.inputs, "tokens_input", lambda ids: {"prompt_token_ids": ids}
    )

    return _Vllm(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        KVEventsConfig=KVEventsConfig,
        KVTransferConfig=KVTransferConfig,
        # vLLM adds a PrometheusStatLogger unless one is given: ours stands in for it (a worker serves no vLLM
        # metrics endpoint; its load goes out on NATS), which saves a Prometheus update per engine step.
        StatLoggerBase=getattr(loggers, "PrometheusStatLogger", loggers.StatLoggerBase),
        tokens_input=tokens_input,
        EngineDeadError=VllmEngineDeadError,
        EngineGenerateError=EngineGenerateError,
        ClientError=client_error,
    )


def _stat_logger_class(base: type, stats: VllmStats) -> type:
    """A stat logger that feeds ``stats``; vLLM calls ``record`` on its output-handler task, i.e. on this process's
    event loop, so no locking is needed.

    ``base`` is vLLM's ``PrometheusStatLogger`` where it exists: vLLM then takes this logger as the deployment's
    Prometheus logger and adds none of its own. ``__init__`` registers no metric, and every hook vLLM calls on a
    logger is overridden, so nothing of the base class runs.
    """

    class KvmeshStatLogger(base):  # type: ignore[valid-type,misc]
        def __init__(self, vllm_config: Any, engine_indexes: Any = None, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self.engine_indexes = engine_indexes if isinstance(engine_indexes, list) else [engine_index]

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass  # num_gpu_blocks is read from the engine's config once start() has it

        def log(self) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

    return KvmeshStatLogger


@dataclasses.dataclass(slots=True)
class HandoffCounters:
    """What became of the KV hand-offs an engine received: remotely prefilled prompts (``generate_remote``,
    ``VllmEngine.handoffs``) or migrated requests (``commit_migration``, ``VllmEngine.migrations_in``)."""

    pulled: int = 0  # submitted with the other engine's KV hand-off (vLLM pulls; a failed pull it recomputes)
    refused: int = 0  # a hand-off ``check_handoff`` refused (or this engine has no connector): recomputed instead
    recomputed: int = 0  # computed again here (refused hand-offs included)
    # Of those pulled, how many vLLM computed again because the pull failed (the source died): seen as NIXL failures
    # recorded before the request's first output (``VllmEngine._stream``), each failure counted once.
    pull_failed: int = 0


_runtime_dir: str | None = None


def process_runtime_dir() -> str:
    """This process's private directory for vLLM's ipc sockets (0700), created once, set as ``VLLM_RPC_BASE_PATH``
    for the vLLM processes it starts (with ``OWNER_PID_ENV``/``RUNTIME_DIR_ENV`` for their lifeline), removed at exit
    (by them, if this process is killed)."""
    global _runtime_dir
    if _runtime_dir is None or not os.path.isdir(_runtime_dir):
        base = tempfile.gettempdir()
        # An ipc:// path must fit sockaddr_un (107 bytes): vLLM puts a 36-character uuid, the KV-event sockets a
        # subdirectory and a socket name, under this directory. A long TMPDIR falls back to /tmp.
        if len(base) > 40 and os.path.isdir("/tmp"):
            base = "/tmp"
        _runtime_dir = tempfile.mkdtemp(prefix=f"kvmesh-vllm-{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, _runtime_dir, True)
    os.environ["VLLM_RPC_BASE_PATH"] = _runtime_dir
    os.environ[RUNTIME_DIR_ENV] = _runtime_dir
    os.environ[OWNER_PID_ENV] = str(os.getpid())
    return _runtime_dir


@dataclasses.dataclass(slots=True, eq=False)
class _Run:
    """One request's life in this adapter across its submissions to vLLM (a suspension and resumption resubmits
    it as a continuation under a new vLLM id): the client's request and every output token so far."""

    request: GenerateRequest
    outputs: list[int]
    vllm_id: str
    submissions: int = 0
    suspending: bool = False  # suspend() aborted it in vLLM; its final "abort" output means suspended
    suspended: bool = False
    num_cached_tokens: int = 0
    # The first submission's extras (a disaggregated hand-off, nixl.py): a max_tokens of its own, vLLM
    # kv_transfer_params to keep or pull, and where the final output's kv_transfer_params are copied. A continuation
    # (after a suspension) is computed from this engine's prefix cache and carries none of them.
    max_tokens: int | None = None
    kv_transfer_params: Mapping[str, Any] | None = None
    handoff: dict[str, Any] | None = None


class VllmEngine:
    """A vLLM engine. ``start()`` it (~10 s), ``generate()`` on it, ``shutdown()`` it (~4 s)."""

    # Until start() has decided (``nixl.choose_remote_prefill_mode``, ``choose_migration_mode``): what an engine
    # without a connector does.
    remote_prefill_mode = RemotePrefillMode.RECOMPUTE
    migration_mode = MigrationMode.RECOMPUTE

    def __init__(
        self,
        config: VllmEngineConfig,
        *,
        name: str = "vllm",
        role: WorkerRole = WorkerRole.AGGREGATED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = name
        # The worker's role decides the KV connector's: a prefill engine keeps KV for pulls, a decode engine pulls.
        self.role = role
        self.remote_prefill_mode = RemotePrefillMode.RECOMPUTE
        self.remote_prefill_reason = "not started"
        # How a running request leaves this engine (module docstring), decided by start() like remote_prefill_mode.
        self.migration_mode = MigrationMode.RECOMPUTE
        self.migration_reason = "not started"
        self.kv_role: str | None = None  # the NIXL connector's role (None: no connector)
        self.kv_transfer_port = 0  # this engine's NIXL handshake port (0: no connector)
        self.handoffs = HandoffCounters()
        self.migrations_in = HandoffCounters()
        self.num_exports = 0  # kv_transfer migrations out: hand-offs made (export_kv)
        self.num_export_failures = 0  # ... and those it could not make (the destination then recomputes)
        self._reservations: dict[str, str] = {}  # incoming kv_transfer migration id -> request id
        self._failures_attributed = 0  # NIXL failures already counted as a failed pull
        self._export_ids = itertools.count(1)
        # Both are replaced by what vLLM settled on once start() returns (max_model_len may come from the model).
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or 0
        self.vocab_size = 0
        self._clock = clock
        self._vllm: _Vllm | None = None
        self._llm: Any = None
        self._stats = VllmStats()
        self._requests: dict[str, RequestProgress] = {}
        self._runs: dict[str, _Run] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # What hooks.py reported from vLLM's model worker (lifeline, sampler continuation); {} until started.
        self.hooks: dict[str, Any] = {}
        self._translator = KvEventTranslator(config.block_size)
        # What ends a request at EOS (the generation config's ids, as vLLM stops on them with skip_tokenizer_init).
        self.eos_token_ids: set[int] = set()
        self._kv_batches: collections.deque[list[KvEvent]] = collections.deque()
        self._kv_ready = asyncio.Event()
        self._subscriber: Any = None
        self._subscriber_task: asyncio.Task[None] | None = None
        self._tmpdir: str | None = None
        self._closed = False
        self.num_dropped_kv_event_batches = 0
        self.num_bad_kv_event_batches = 0

    # --- lifecycle --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._llm is not None:
            return
        if self._closed:
            raise EngineDeadError(f"vLLM engine {self.name!r} was shut down")
        changed = apply_vllm_environment(self.config, os.environ)
        if changed:
            logger.debug("vLLM environment: %s", changed)
        unavailable = nixl_unavailable_reason()
        try:
            mode, prefill_role, reason = choose_remote_prefill_mode(
                str(self.role), self.config.remote_prefill_mode, unavailable
            )
            migration, migration_reason = choose_migration_mode(str(self.role), self.config.migration_mode, unavailable)
        except ValueError as exc:
            raise EngineDeadError(f"vLLM engine {self.name!r}: {exc}") from exc
        kv_role = connector_role(prefill_role, migration == MigrationMode.KV_TRANSFER)
        # Without the connector the engine still serves, by recompute: unless a mode that needs it was required.
        required = (prefill_role is not None and self.config.remote_prefill_mode == "kv_transfer") or (
            migration == MigrationMode.KV_TRANSFER and self.config.migration_mode == "kv_transfer"
        )
        t0 = time.perf_counter()
        runtime_dir = process_runtime_dir()
        v = self._vllm = await asyncio.to_thread(_import_vllm)
        # mkdtemp makes the directory 0700: only this user can reach the sockets inside.
        self._tmpdir = tempfile.mkdtemp(prefix="kv-", dir=runtime_dir)
        try:
            llm = await self._build(v, kv_role)
        except EngineDeadError as exc:
            if self._closed or kv_role is None or required:
                self._remove_tmpdir()
                raise
            # NIXL is installed but the engine did not start with it (a broken package, a port taken meanwhile):
            # a worker that recomputes beats no worker.
            logger.warning("vLLM engine %s: %s; starting again without a KV connector", self.name, exc)
            reason = migration_reason = f"the engine did not start with the NIXL connector: {exc}"
            mode, migration, kv_role = RemotePrefillMode.RECOMPUTE, MigrationMode.RECOMPUTE, None
            try:
                llm = await self._build(v, None)
            except EngineDeadError:
                self._remove_tmpdir()
                raise
        self.remote_prefill_mode = RemotePrefillMode(mode)
        self.remote_prefill_reason = reason
        self.migration_mode = MigrationMode(migration)
        self.migration_reason = migration_reason
        self.kv_role = kv_role
        if self.role != WorkerRole.PREFILL:
            fallback = migration == MigrationMode.RECOMPUTE and self.config.migration_mode != "recompute"
            log = logger.warning if fallback else logger.info
            log("vLLM engine %s: migration_mode %s: %s", self.name, migration, migration_reason)
        if self.role != WorkerRole.AGGREGATED:
            if prefill_role is not None and kv_role is not None:
                logger.info(
                    "vLLM engine %s: remote_prefill_mode kv_transfer: %s, handshake on %s:%d, lease %d s",
                    self.name,
                    reason,
                    self.config.kv_transfer_host,
                    self.kv_transfer_port,
                    self.config.kv_transfer_lease_s,
                )
            else:
                logger.warning(
                    "vLLM engine %s (%s worker): remote_prefill_mode recompute: %s", self.name, self.role, reason
                )
        self._llm = llm
        if hasattr(llm, "_run_output_handler"):
            llm._run_output_handler()
        cache = llm.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self._stats.num_total_blocks = int(cache.num_gpu_blocks) - 1  # vLLM keeps one null block
        self.max_model_len = int(llm.model_config.max_model_len)
        self.vocab_size = int(llm.model_config.get_vocab_size())
        self.eos_token_ids = _eos_token_ids(llm.model_config)
        self._translator = KvEventTranslator(self.block_size)
        if self.config.enable_prefix_caching:
            self._start_subscriber(llm)
        try:
            [self.hooks] = await llm.collective_rpc("kvmesh_install_hooks")
        except Exception as e:  # noqa: BLE001 - another vLLM without the extension: serves, but says what it lacks
            logger.warning("vLLM engine %s: kvmesh hooks not installed in its worker (%s)", self.name, e)
            self.hooks = {}
        if not self.hooks.get("sampler_continuation"):
            logger.warning("vLLM engine %s: seeded requests continued here will not resume their sampler", self.name)
        logger.info(
            "vLLM engine %s ready in %.1f s: %s, %d blocks of %d tokens, max_model_len %d, vocabulary %d",
            self.name,
            time.perf_counter() - t0,
            self.config.model_path,
            self._stats.num_total_blocks,
            self.block_size,
            self.max_model_len,
            self.vocab_size,
        )

    async def _build(self, v: _Vllm, kv_role: str | None) -> Any:
        """Build the ``AsyncLLM`` in a thread (~10 s), with kvmesh's NIXL connector in ``kv_role`` unless None."""
        kv_transfer = None
        self.kv_transfer_port = 0
        if kv_role is not None:
            for key, value in UCX_ENVIRONMENT.items():
                os.environ.setdefault(key, value)  # read by the model process when vLLM spawns it
            try:
                self.kv_transfer_port = free_loopback_port(self.config.kv_transfer_host)
            except OSError as exc:
                raise EngineDeadError(
                    f"vLLM engine {self.name!r}: no port for NIXL's handshake on {self.config.kv_transfer_host}: {exc}"
                ) from exc
            kv_transfer = v.KVTransferConfig(
                **kv_transfer_config(
                    kv_role=kv_role,
                    host=self.config.kv_transfer_host,
                    port=self.kv_transfer_port,
                    lease_s=self.config.kv_transfer_lease_s,
                )
            )
        args = v.AsyncEngineArgs(
            **engine_arguments(self.config), kv_events_config=self._kv_events_config(v), kv_transfer_config=kv_transfer
        )
        build = asyncio.ensure_future(
            asyncio.to_thread(
                v.AsyncLLM.from_engine_args, args, stat_loggers=[_stat_logger_class(v.StatLoggerBase, self._stats)]
            )
        )
        try:
            llm = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be stopped and its engine processes would outlive us: let it finish, then shut the
            # engine down before letting the cancellation through (up to ~10 s late).
            await self._discard(build)
            raise
        except Exception as exc:  # vLLM raises RuntimeError, ValueError, OSError... all mean "no engine"
            raise EngineDeadError(f"vLLM engine {self.name!r} failed to start: {exc}") from exc
        if self._closed:  # shutdown() ran while we were starting
            await self._discard(build)
            raise EngineDeadError(f"vLLM engine {self.name!r} was shut down while starting")
        return llm

    def _kv_events_config(self, v: _Vllm) -> Any:
        if not self.config.enable_prefix_caching:
            return None  # vLLM publishes events only for its prefix cache
        assert self._tmpdir is not None
        return v.KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            # ipc:// endpoints are bound by vLLM's publisher (it connects to plain tcp://host:port ones): local only.
            endpoint=f"ipc://{self._tmpdir}/kv-events.sock",
            replay_endpoint=f"ipc://{self._tmpdir}/kv-events-replay.sock",
            buffer_steps=self.config.kv_events_replay_steps,
            topic=KV_EVENTS_TOPIC,
        )

    def _start_subscriber(self, llm: Any) -> None:
        from .events import KvEventSubscriber

        # The publisher reports the endpoints it actually bound (the same ipc paths; read back to be sure).
        source = llm.engine_core.get_kv_event_sources()[0]
        self._subscriber = KvEventSubscriber(
            source.endpoint, source.replay_endpoint, self._on_kv_batch, topic=KV_EVENTS_TOPIC
        )
        self._subscriber_task = asyncio.create_task(self._subscriber.run(), name=f"vllm-kv-events:{self.name}")

    async def shutdown(self, process_timeout_s: float | None = None) -> None:
        """Abort what is still running, stop the KV-event subscriber, shut vLLM's processes down, end
        ``kv_events()``. ``process_timeout_s``: how long vLLM waits for its engine core to exit after SIGTERM before
        it SIGKILLs it (None: vLLM's own default, 5 s)."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        try:
            if llm is not None and self._runs:
                try:
                    await llm.abort([run.vllm_id for run in self._runs.values()])
                except Exception as e:  # noqa: BLE001 - the engine may already be dead; release the rest anyway
                    logger.warning("vLLM engine %s: aborting %d requests: %s", self.name, len(self._runs), e)
            task, self._subscriber_task = self._subscriber_task, None
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # our own caller is cancelling us: let it through (the finally still releases)
        finally:
            if self._subscriber is not None:
                self._subscriber.close()
                self._subscriber = None
            if llm is not None:
                t0 = time.perf_counter()
                # Stop vLLM's output handler first: shutdown() runs in a thread while this loop keeps going, and the
                # handler would otherwise see the engine core exit and log it as a failure ("EngineDeadError").
                handler = getattr(llm, "output_handler", None)
                if isinstance(handler, asyncio.Task) and not handler.done():
                    handler.cancel()
                    await asyncio.wait({handler})  # not `await handler`: its CancelledError is not ours to swallow
                try:
                    await asyncio.to_thread(llm.shutdown, process_timeout_s)
                finally:
                    # Drop the last reference while the interpreter is whole: AsyncLLM.__del__ shuts down again, and
                    # at interpreter exit vLLM's module globals are already None.
                    del llm
                    logger.info("vLLM engine %s shut down in %.1f s", self.name, time.perf_counter() - t0)
            self._remove_tmpdir()
            self._kv_ready.set()

    async def _discard(self, build: asyncio.Future[Any]) -> None:
        """Shut down the engine ``build`` makes, once it is made; release the temporary directory."""
        try:
            llm = await build
        except Exception as exc:  # noqa: BLE001 - it failed to start: there is nothing to shut down
            logger.debug("vLLM engine %s: discarded start failed: %r", self.name, exc)
        else:
            await asyncio.to_thread(llm.shutdown)
            del llm
        finally:
            self._remove_tmpdir()

    def _remove_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # --- requests ---------------------------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's new tokens, numbered from its position (``TokenChunk.position``; a continuation,
        ``num_output_tokens`` > 0, starts there and resumes a seeded sampler: module docstring); the first chunk of
        a new request carries the prompt and prefix-cache counts, the last a ``finish_reason``. Closing the iterator
        early aborts the request in vLLM (its blocks are freed). A ``suspend`` makes it yield a ``SuspendedChunk``
        once vLLM's last tokens are out, after which it continues (resumed) or is closed (moved elsewhere)."""
        return self._stream(request)

    async def _stream(
        self,
        request: GenerateRequest,
        *,
        max_tokens: int | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        handoff: dict[str, Any] | None = None,
        counters: HandoffCounters | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """``generate()``, optionally with ``max_tokens`` replaced and vLLM ``kv_transfer_params`` attached (a hand-off
        to keep, or one to pull: ``nixl``); the final output's ``kv_transfer_params`` are copied into ``handoff``.
        ``counters``: where a pull that failed is counted (``HandoffCounters.pull_failed``)."""
        llm, v = self._check_alive()
        run = self._new_run(request, v, max_tokens=max_tokens, kv_transfer_params=kv_transfer_params, handoff=handoff)
        # A pull that fails is computed again by vLLM and says so only in its NIXL failure counters: a failure
        # recorded between the submission and the first output is this pull's (each failure counted once).
        failures_before = self._stats.num_kv_transfer_failures if counters is not None else None
        rid = request.request_id
        progress = RequestProgress(num_prompt_tokens=len(request.token_ids))
        self._requests[rid] = progress
        self._runs[rid] = run
        prompt = request.prompt_token_ids
        try:
            while True:
                params = self._params(v, run)
                stream = llm.generate(v.tokens_input([*prompt, *run.outputs]), params, run.vllm_id)
                suspended = False
                try:
                    while True:
                        try:
                            out = await anext(stream)
                        except StopAsyncIteration:
                            return  # vLLM ends a stream only after its finished output; nothing more to say
                        except v.ClientError as exc:  # prompt too long, admission control
                            raise EngineRequestError(f"request {rid!r}: {exc}") from exc
                        except v.EngineDeadError as exc:
                            raise EngineDeadError(f"vLLM engine {self.name!r} died: {exc}") from exc
                        except v.EngineGenerateError as exc:  # recoverable per vLLM: this request failed
                            raise EngineRequestError(f"request {rid!r} failed in vLLM: {exc.__cause__!r}") from exc
                        completion = out.outputs[0]
                        reason = finish_reason(completion.finish_reason) if out.finished else None
                        if run.handoff is not None and out.kv_transfer_params:
                            run.handoff.update(out.kv_transfer_params)
                        chunk = TokenChunk(token_ids=list(completion.token_ids), position=len(run.outputs))
                        if not progress.started:
                            progress.started = True
                            if failures_before is not None and counters is not None:
                                self._count_pull_failure(rid, failures_before, counters)
                                failures_before = None
                            if chunk.position == 0:
                                chunk.num_prompt_tokens = len(prompt)
                                chunk.num_cached_tokens = run.num_cached_tokens = int(out.num_cached_tokens or 0)
                        run.outputs += chunk.token_ids
                        progress.num_output_tokens += len(chunk.token_ids)
                        if reason == FinishReason.ABORT and run.suspending:
                            suspended = True  # aborted by suspend(): not the request's end
                            if chunk.token_ids:
                                yield chunk
                            break
                        chunk.finish_reason = reason
                        yield chunk
                        if out.finished:
                            return
                finally:
                    # A no-op for a finished stream; otherwise vLLM's generator aborts the request on GeneratorExit.
                    await stream.aclose()
                if not suspended:
                    return
                run.suspending, run.suspended = False, True
                yield SuspendedChunk(token_ids=[])
                # Resumed here (or closed at the yield, once moved): go on as a continuation under a new vLLM id.
                run.suspended = False
                run.submissions += 1
                run.vllm_id = f"{rid}#{run.submissions}"
                progress.started = False
        finally:
            if self._requests.get(rid) is progress:
                del self._requests[rid]
            if self._runs.get(rid) is run:
                del self._runs[rid]

    def _count_pull_failure(self, request_id: str, before: int, counters: HandoffCounters) -> None:
        now = self._stats.num_kv_transfer_failures
        if now > max(before, self._failures_attributed):
            self._failures_attributed = now
            counters.pull_failed += 1
            logger.warning(
                "vLLM engine %s: request %s: the KV pull failed; vLLM computed it again", self.name, request_id
            )

    def _new_run(
        self,
        request: GenerateRequest,
        v: _Vllm,
        *,
        max_tokens: int | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        handoff: dict[str, Any] | None = None,
    ) -> _Run:
        """Check ``request`` (raising ``EngineRequestError``) and make its run."""
        rid = request.request_id
        validate_prompt(request.token_ids, self.vocab_size)
        if rid in self._requests:
            raise DuplicateRequestError(rid)
        n = request.num_output_tokens
        run = _Run(
            request,
            list(request.token_ids[len(request.token_ids) - n :]) if n else [],
            rid,
            max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params,
            handoff=handoff,
        )
        if n >= request.sampling.max_tokens:
            raise EngineRequestError(
                f"request {rid!r}: a continuation of {n} output tokens has nothing left to produce under "
                f"max_tokens = {request.sampling.max_tokens}"
            )
        self._params(v, run)
        return run

    def _params(self, v: _Vllm, run: _Run) -> Any:
        """vLLM's ``SamplingParams`` for the rest of ``run``: ``max_tokens`` less the outputs it has, and for a
        seeded request the sampler draws its earlier submissions made (hooks.py)."""
        kwargs = sampling_kwargs(run.request.sampling)
        extra: dict[str, Any] = {}
        if run.submissions == 0:
            if run.max_tokens is not None:
                kwargs["max_tokens"] = run.max_tokens
            if run.kv_transfer_params is not None:
                extra["kv_transfer_params"] = dict(run.kv_transfer_params)
        n = len(run.outputs)
        if n:
            kwargs["max_tokens"] -= n
            if run.request.sampling.seed is not None:
                extra[SAMPLER_DRAWS_KEY] = n
        if extra:
            kwargs["extra_args"] = extra
        try:
            return v.SamplingParams(**kwargs, output_kind=v.RequestOutputKind.DELTA, detokenize=False)
        except (ValueError, TypeError, v.ClientError) as exc:
            raise EngineRequestError(f"request {run.request.request_id!r}: {exc}") from exc

    # --- disaggregation: a prompt's KV moves from a prefill engine to a decode engine (nixl.py) --------------------

    async def prefill_handoff(self, request: GenerateRequest) -> tuple[TokenChunk | None, dict[str, Any] | None]:
        """Prefill ``request``'s prompt and sample its first token (``max_tokens=1``), keeping the KV for another
        engine to pull (a prefill worker's engine, ``remote_prefill_mode`` kv_transfer). Returns the first chunk
        (None if the engine produced no token) and the ``kv_transfer_params`` naming the kept blocks (None without a
        connector, or when vLLM kept nothing). Blocks nobody pulls are freed at the end of the lease."""
        keep = dict(SOURCE_PARAMS) if self.remote_prefill_mode == RemotePrefillMode.KV_TRANSFER else None
        handoff: dict[str, Any] = {}
        first: TokenChunk | None = None
        async with contextlib.aclosing(
            self._stream(request, max_tokens=1, kv_transfer_params=keep, handoff=handoff)
        ) as chunks:
            async for chunk in chunks:
                if chunk.token_ids and first is None:
                    first = chunk
                if chunk.finish_reason is not None:
                    break
        if first is None or keep is None or not handoff:
            return first, None
        return first, handoff

    async def generate_remote(
        self, request: GenerateRequest, prefill: Callable[[], Awaitable[RemotePrefillResult | None]]
    ) -> AsyncGenerator[TokenChunk, None]:
        """Decode a request another engine prefilled (``prefill()`` waits for its ``RemotePrefillResult``).

        * **kv_transfer** (this engine has the NIXL connector, the result names the KV, ``check_handoff`` accepts
          it): the prompt is submitted with the hand-off; vLLM pulls the prompt's blocks from the prefill engine and
          computes only the last prompt token, then samples the first output token itself, so the client's stream is
          this engine's one generation (greedy and seeded sampling alike). A pull that fails (the prefill engine
          died) is recomputed by vLLM: slower, still whole.
        * **recompute** (no connector, no hand-off, or one refused): the prefill worker's first token is streamed
          at once, and this engine generates the rest from the prompt plus that token (``max_tokens - 1`` more) as a
          continuation, so greedy output is what an aggregated worker gives and a seeded sampler resumes after the
          prefill worker's draw (hooks.py).

        ``prefill()`` returning None (or an error result): the request is generated here from the start."""
        result = await prefill()
        if result is None or result.error or not result.token_ids:
            async with contextlib.aclosing(self.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        params = result.kv_transfer_params
        if params and self.remote_prefill_mode == RemotePrefillMode.KV_TRANSFER:
            problem = check_handoff(params, len(request.token_ids), self.block_size)
            if problem is None:
                self.handoffs.pulled += 1
                stream = self._stream(request, kv_transfer_params=params, counters=self.handoffs)
                async with contextlib.aclosing(stream) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            self.handoffs.refused += 1
            logger.warning("request %s: KV hand-off refused (%s): recomputing the prompt", request.request_id, problem)
        self.handoffs.recomputed += 1
        first = result.token_ids[0]
        finish = self._first_token_finish(request, first)
        yield TokenChunk(
            token_ids=[first],
            finish_reason=finish,
            num_prompt_tokens=len(request.token_ids),
            num_cached_tokens=result.num_cached_tokens,
        )
        if finish is not None:
            return
        # A continuation after the first token: positions from 1 on, a seeded sampler one draw on.
        rest = GenerateRequest(request.request_id, [*request.token_ids, first], request.sampling, num_output_tokens=1)
        async with contextlib.aclosing(self.generate(rest)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _first_token_finish(self, request: GenerateRequest, token: int) -> FinishReason | None:
        """Whether a request ends with its first output token (vLLM's order: length caps, then EOS, then stop ids)."""
        sp = request.sampling
        if sp.max_tokens <= 1 or len(request.token_ids) + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        if not sp.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
        return None

    # --- hot-prefix replication: a cached prefix's KV copied to another engine (components/workers/replication.py) -

    def prefix_copy_refusal(self) -> str | None:
        """Why this engine can take no part in a copy of a prefix's KV (None when it can): the copy is a NIXL hand-off
        (nixl.py), so an engine without the connector neither exports nor pulls one."""
        if self.kv_role is None:
            return f"this vLLM engine has no KV connector ({self.migration_reason})"
        if not self.config.enable_prefix_caching:
            return "this vLLM engine runs without prefix caching: a copied prefix would not stay"
        return None

    async def export_prefix(self, kvmesh_hashes: list[int]) -> tuple[int, list[int], dict[str, Any] | None, str]:
        """The source of a prefix copy: ``(held, token_ids, handoff, error)``. ``held``: the prefix's blocks, from
        its start, this engine's prefix cache holds (as its KV events told, which also give their tokens); those
        tokens are computed as a request of their own with ``do_remote_decode`` (``export_tokens``: served from the
        prefix cache, vLLM computes the last block again for its logits) and their blocks kept for the pull that
        ``handoff`` names, until the destination has pulled them or ``kv_transfer_lease_s`` ran out."""
        refusal = self.prefix_copy_refusal()
        if refusal is not None:
            return 0, [], None, refusal
        tokens = self._translator.prefix_tokens(kvmesh_hashes)
        if not tokens:
            return 0, [], None, "this engine holds none of the prefix"
        held = len(tokens) // self.block_size
        handoff = await self.export_tokens(tokens, f"prefix-{kvmesh_hashes[held - 1] & 0xFFFFFFFF:08x}")
        if handoff is None:
            return held, tokens, None, "vLLM kept no blocks for a pull (the engine's log says why)"
        return held, tokens, handoff, ""

    async def pull_prefix(self, token_ids: list[int], handoff: Mapping[str, Any]) -> tuple[int, str]:
        """The destination of a prefix copy: pull the blocks ``handoff`` names for ``token_ids`` (whole blocks) into
        this engine's prefix cache; ``(blocks new here, error)``.

        The tokens are submitted with the hand-off and ``max_tokens=1`` (as ``generate_remote`` pulls a remote
        prefill's blocks): vLLM's scheduler allocates blocks for what its prefix cache lacks, its connector reads the
        source's blocks into them, the engine computes the last token for its logits, and the request ends, so the
        blocks stay cached, free, under vLLM's own LRU, and are announced with ``BlockStored`` like any other. The
        sampled token is discarded. The request is not a client's: it is in neither the load report nor the
        migration agent's table. A pull that fails is computed here again by vLLM (``kv_load_failure_policy``):
        the error then says so."""
        refusal = self.prefix_copy_refusal()
        if refusal is not None:
            return 0, refusal
        llm, v = self._check_alive()
        problem = check_handoff(handoff, len(token_ids), self.block_size)
        if problem is None and len(token_ids) % self.block_size:
            problem = f"{len(token_ids)} tokens are not whole blocks of {self.block_size}"
        if problem is not None:
            return 0, f"the source's hand-off cannot be pulled: {problem}"
        validate_prompt(token_ids, self.vocab_size)  # ids from another worker's events: one out of range kills vLLM
        new = len(token_ids) // self.block_size - self._cached_blocks(token_ids)
        failures = self._stats.num_kv_transfer_failures
        params = v.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            output_kind=v.RequestOutputKind.FINAL_ONLY,
            detokenize=False,
            extra_args={"kv_transfer_params": dict(handoff)},
        )
        stream = llm.generate(v.tokens_input(list(token_ids)), params, f"prefix-pull#{next(self._export_ids)}")
        try:
            async for out in stream:
                if out.finished:
                    break
        except v.EngineDeadError as exc:
            raise EngineDeadError(f"vLLM engine {self.name!r} died: {exc}") from exc
        except (v.ClientError, v.EngineGenerateError) as exc:
            return 0, f"vLLM refused or failed the pull: {exc!r}"
        finally:
            await stream.aclose()
        if self._stats.num_kv_transfer_failures > failures:
            return new, "the NIXL pull failed; vLLM computed the prefix here instead"
        return new, ""

    async def drop_prefix(self, kvmesh_hashes: list[int]) -> tuple[int, int]:
        """Evict the prefix's cached blocks that no request holds; ``(dropped, in use)``, counted in distinct blocks
        of the prefix this engine held. vLLM's client API evicts nothing less than the whole cache, so this calls
        the engine-core method hooks.py adds (``kvmesh_drop_blocks``: the KV cache manager's ``evict_blocks``), which
        publishes ``BlockRemoved`` as any eviction does. Raises ``EngineRequestError`` with the reason where it
        cannot (no prefix caching, an engine core without kvmesh's scheduler), ``EngineDeadError`` for a dead one."""
        llm, _ = self._check_alive()
        if not self.config.enable_prefix_caching:
            raise EngineRequestError("this vLLM engine runs without prefix caching: it holds no prefix to drop")
        wanted = self._translator.vllm_hashes(kvmesh_hashes)
        if not wanted:
            return 0, 0
        try:
            dropped, in_use = await llm.engine_core.call_utility_async(DROP_UTILITY, wanted)
        except Exception as exc:  # vLLM's client raises a bare Exception carrying the engine core's message
            if llm.errored:
                raise EngineDeadError(f"vLLM engine {self.name!r} is dead: {llm.dead_error!r}") from exc
            raise EngineRequestError(f"vLLM's engine core could not evict the prefix: {exc}") from exc
        return int(dropped), int(in_use)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading prompt tokens vLLM's prefix cache holds now, as its KV events told (whole blocks, at most
        ``len - 1`` tokens); 0 before the engine started or without prefix caching."""
        translator = self._translator
        if translator is None or not token_ids or not self.config.enable_prefix_caching:
            return 0
        bs = self.block_size
        n = 0
        for h in block_hashes(token_ids[: (len(token_ids) - 1) // bs * bs], bs):
            if not translator.holds(h):
                break
            n += bs
        return n

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its ``generate()`` ends with an ``abort`` chunk. Unknown ids are ignored."""
        run = self._runs.get(request_id)
        if run is not None and self._llm is not None:
            run.suspending = False  # an abort wins over a suspension in progress
            await self._llm.abort(run.vllm_id)

    # --- migration (components/migration/engine.py): kv_transfer, or by recompute ---------------------------------

    def request_table(self) -> RequestTable:
        """Requests with output so far as running (in arrival order), the others as waiting."""
        running: list[RequestView] = []
        waiting: list[RequestView] = []
        for rid, run in self._runs.items():
            progress = self._requests.get(rid)
            view = RequestView(rid, len(run.request.prompt_token_ids), len(run.outputs))
            (running if progress is not None and progress.started else waiting).append(view)
        return RequestTable(tuple(running), tuple(waiting), self._stats.num_total_blocks * self.block_size)

    def kv_extent(self, request_id: str) -> KvExtent | None:
        """kv_transfer: the blocks the request's prompt + outputs fill now (what ``export_kv`` would hand over; the
        agent reserves room for them on the destination before suspending). None by recompute (no KV leaves this
        engine) or for a request not running here."""
        run = self._runs.get(request_id)
        if run is None or self.migration_mode != MigrationMode.KV_TRANSFER:
            return None
        tokens = [*run.request.prompt_token_ids, *run.outputs]
        bs = self.block_size
        full = len(tokens) // bs
        return KvExtent(full, -(-len(tokens) // bs), tokens[: full * bs])

    def suspend(self, request_id: str) -> bool:
        """Abort the request in vLLM; its stream then delivers vLLM's last tokens and a ``SuspendedChunk``. False
        when it is not running here or is already being suspended."""
        run, llm = self._runs.get(request_id), self._llm
        if run is None or llm is None or run.suspending or run.suspended:
            return False
        run.suspending = True
        task = asyncio.get_running_loop().create_task(llm.abort(run.vllm_id), name=f"vllm-suspend:{request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    def suspended_state(self, request_id: str) -> MigratingRequest | None:
        run = self._runs.get(request_id)
        if run is None or not run.suspended:
            return None
        return MigratingRequest(
            request_id=request_id,
            prompt_token_ids=list(run.request.prompt_token_ids),
            output_token_ids=list(run.outputs),
            sampling=run.request.sampling,
            num_computed_tokens=0,
            num_cached_tokens=run.num_cached_tokens,
        )

    async def export_kv(self, request_id: str) -> dict[str, Any] | None:
        """kv_transfer, the source's final stage: make the suspended request's KV (prompt + outputs, N tokens)
        pullable and return the hand-off naming it (vLLM's ``kv_transfer_params``), or None when it cannot (not
        kv_transfer, not suspended, vLLM refused or failed): the destination then computes the request again.

        vLLM exports nothing of an aborted request, so the suspended request's tokens are submitted again
        (``export_tokens``): its prefix cache still holds the aborted request's whole blocks, so vLLM computes at
        most the last partial block. Blocks nobody pulls are freed when ``kv_transfer_lease_s`` runs out (also when
        the migration fails after this: the request resumed here finds them in its prefix cache meanwhile)."""
        run = self._runs.get(request_id)
        if self.migration_mode != MigrationMode.KV_TRANSFER or run is None or not run.suspended:
            return None
        self.num_exports += 1
        handoff = await self.export_tokens([*run.request.prompt_token_ids, *run.outputs], run.vllm_id)
        if handoff is None:
            self.num_export_failures += 1
        return handoff

    async def export_tokens(self, token_ids: list[int], name: str) -> dict[str, Any] | None:
        """Compute ``token_ids`` (from the prefix cache where it holds them) as a request of their own with
        ``max_tokens=1`` and ``do_remote_decode`` (nixl.py), keep their KV for a pull, and return the hand-off that
        names it (checked: ``check_handoff``); None without a connector or when vLLM refused, failed or named
        other blocks. The token vLLM samples is discarded: the target samples the next token itself, with the
        request's own sampling state. ``name``: a prefix of the vLLM request id (logs)."""
        llm, v = self._llm, self._vllm
        if self.kv_role is None or llm is None or v is None or llm.errored:
            return None
        params = v.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            output_kind=v.RequestOutputKind.FINAL_ONLY,
            detokenize=False,
            extra_args={"kv_transfer_params": dict(SOURCE_PARAMS)},
        )
        handoff: dict[str, Any] | None = None
        stream = llm.generate(v.tokens_input(list(token_ids)), params, f"{name}#kv{next(self._export_ids)}")
        try:
            async for out in stream:
                if out.finished:
                    handoff = dict(out.kv_transfer_params or {})
                    break
        except (v.ClientError, v.EngineDeadError, v.EngineGenerateError) as exc:
            logger.warning("vLLM engine %s: KV export of %s failed: %r", self.name, name, exc)
            handoff = None
        finally:
            await stream.aclose()
        problem = check_handoff(handoff, len(token_ids), self.block_size)
        if problem is not None:
            logger.warning("vLLM engine %s: no KV hand-off for %s (%s)", self.name, name, problem)
            return None
        return handoff

    def resume(self, request_id: str) -> bool:
        """The stream goes on here (it resubmits the request as a continuation when next read)."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        run.suspending = False
        return True

    def transfer_time_s(self, num_blocks: int) -> float:
        return 0.0  # vLLM's connector moves real bytes (kv_transfer), or nothing moves (recompute)

    def reserve_migration(self, migration_id: str, request_id: str, token_ids: list[int]) -> int | None:
        """kv_transfer, the destination: room for a request whose whole blocks hold ``token_ids``. vLLM cannot set
        blocks aside ahead of a request: this only checks that this engine lives and has the blocks free now (by
        its latest KV usage) beyond what its prefix cache already holds, and remembers the migration; vLLM allocates
        when ``commit_migration`` submits it (and queues it if the blocks went meanwhile). Returns the leading
        blocks its prefix cache holds (not pulled), None without room."""
        if self.migration_mode != MigrationMode.KV_TRANSFER:
            raise EngineRequestError("this vLLM engine migrates by recompute: it takes no KV blocks")
        self._check_alive()
        if migration_id in self._reservations or request_id in self._runs:
            raise EngineRequestError(f"request {request_id!r} already runs or migrates here")
        cached = self._cached_blocks(token_ids)
        need = len(token_ids) // self.block_size + 1 - cached  # whole blocks, the partial last one, less the hits
        free = int(self._stats.num_total_blocks * (1.0 - self._stats.kv_usage))
        if need > free:
            return None
        self._reservations[migration_id] = request_id
        return cached

    def _cached_blocks(self, token_ids: list[int]) -> int:
        """Leading whole blocks of ``token_ids`` this engine's prefix cache holds, as its KV events told."""
        if not self.config.enable_prefix_caching:
            return 0
        n = 0
        for h in block_hashes(token_ids[: len(token_ids) // self.block_size * self.block_size], self.block_size):
            if not self._translator.holds(h):
                break
            n += 1
        return n

    def extend_migration(self, migration_id: str, token_ids: list[int]) -> bool:
        return migration_id in self._reservations  # nothing is copied while the request decodes (no pre-copy)

    def cancel_migration(self, migration_id: str) -> bool:
        return self._reservations.pop(migration_id, None) is not None

    def commit_migration(self, migration_id: str | None, request: MigratingRequest) -> AsyncGenerator[TokenChunk, None]:
        """Continue ``request`` here as a continuation (prompt + outputs, ``max_tokens`` less them, the seeded
        sampler's draws replayed: module docstring). With a hand-off (``request.kv_transfer_params``) that this
        engine can use (kv_transfer, ``check_handoff``), vLLM pulls the KV of every token and computes only the last
        one; otherwise it computes them again, and ``request.kv_transfer_params`` is cleared to say so. Raises at
        once (a dead engine, a bad or duplicate request, a reservation it does not hold) so the commit can be
        refused."""
        if migration_id is not None and migration_id not in self._reservations:
            raise EngineRequestError(f"migration {migration_id} has nothing reserved here")
        _, v = self._check_alive()
        continuation = GenerateRequest(
            request.request_id, request.all_token_ids, request.sampling, num_output_tokens=request.position
        )
        params = request.kv_transfer_params
        pull: Mapping[str, Any] | None = None
        if params:
            if self.migration_mode != MigrationMode.KV_TRANSFER:
                problem: str | None = "this engine has no KV connector"
            else:
                problem = check_handoff(params, len(continuation.token_ids), self.block_size)
            if problem is None:
                pull = params
            else:
                self.migrations_in.refused += 1
                logger.warning(
                    "request %s: migration's KV hand-off refused (%s): recomputing", request.request_id, problem
                )
                request.kv_transfer_params = None
        self._new_run(continuation, v, kv_transfer_params=pull)  # the checks generate() makes on first iteration, now
        if migration_id is not None:
            del self._reservations[migration_id]
        if pull is not None:
            self.migrations_in.pulled += 1
        else:
            self.migrations_in.recomputed += 1
        return self._stream(continuation, kv_transfer_params=pull, counters=self.migrations_in)

    def _check_alive(self) -> tuple[Any, _Vllm]:
        if self._closed:
            raise EngineDeadError(f"vLLM engine {self.name!r} was shut down")
        llm, v = self._llm, self._vllm
        if llm is None or v is None:
            raise EngineDeadError(f"vLLM engine {self.name!r} is not started: await start() first")
        if llm.errored:
            raise EngineDeadError(f"vLLM engine {self.name!r} is dead: {llm.dead_error!r}")
        return llm, v

    # --- observation ------------------------------------------------------------------------------------------------

    def snapshot(self) -> LoadSnapshot:
        return load_snapshot(self._stats, self._requests.values(), self._clock())

    @property
    def stats(self) -> VllmStats:
        """vLLM's latest numbers, as the stat logger saw them (tests, diagnostics); do not mutate."""
        return self._stats

    @property
    def translator(self) -> KvEventTranslator:
        """The KV-event translator and its mirror of cached blocks (tests, diagnostics); do not mutate."""
        return self._translator

    @property
    def subscriber(self) -> Any:
        """The KV-event subscriber (its counters: batches, replayed, lost), or None without prefix caching."""
        return self._subscriber

    def dead_reason(self) -> str | None:
        """vLLM's own verdict: its output handler marks the client errored when the engine-core process dies."""
        llm = self._llm
        if llm is not None and llm.errored:
            return f"vLLM engine {self.name!r} died: {llm.dead_error!r}"
        return None

    def kv_state(self) -> KvStateSnapshot:
        return self._translator.kv_state()

    async def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        """Batches of KV events in event-id order until shutdown (one consumer: two would split the batches)."""
        while True:
            while not self._kv_batches:
                if self._closed:
                    return
                self._kv_ready.clear()
                await self._kv_ready.wait()
            yield self._kv_batches.popleft()

    async def reset_prefix_cache(self) -> bool:
        """Ask vLLM to forget every cached block (``ALL_CLEARED`` follows with vLLM's next engine step); False when
        running requests hold blocks."""
        llm, _ = self._check_alive()
        return bool(await llm.reset_prefix_cache())

    def _on_kv_batch(self, seq: int, payload: bytes) -> None:
        try:
            _ts, events = decode_kv_event_batch(payload)
            converted = self._translator.translate(events)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            # A malformed batch (another vLLM version's layout) must not stop the subscriber; the next ones may do.
            self.num_bad_kv_event_batches += 1
            logger.warning("vLLM engine %s: undecodable KV-event batch %d: %r", self.name, seq, e)
            return
        if not converted:
            return
        if len(self._kv_batches) >= self.config.max_pending_kv_event_batches:
            self._kv_batches.popleft()
            self.num_dropped_kv_event_batches += 1
        self._kv_batches.append(converted)
        self._kv_ready.set()


def _eos_token_ids(model_config: Any) -> set[int]:
    """The token ids vLLM stops at as EOS for this model: the generation config's ``eos_token_id`` (an id or a list),
    else the model config's; empty when neither says."""
    eos: Any = None
    try:
        eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    except Exception:  # noqa: BLE001 - an unreadable generation config: fall back to the model config
        eos = None
    if eos is None:
        eos = getattr(getattr(model_config, "hf_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(t) for t in (eos if isinstance(eos, list | tuple) else [eos])}
