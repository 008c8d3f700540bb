"""What kvmesh runs inside vLLM's own processes, loaded there by name through two documented engine arguments
(``engine_arguments`` sets them); kvmesh's worker process never imports this module (it imports vLLM at the top).

- ``OwnedScheduler`` (``scheduler_cls``, instantiated in the ``VLLM::EngineCore`` process): vLLM's default
  scheduler (the CPU platform turns async scheduling off, so it is the class vLLM would pick), plus the lifeline.
- ``KvmeshWorkerExtension`` (``worker_extension_cls``, mixed into the ``VLLM::Worker`` process's worker): its
  ``kvmesh_install_hooks`` method, called once by the adapter through ``collective_rpc`` after the engine starts,
  starts the lifeline there and installs the sampler continuation.

**Lifeline.** vLLM's engine processes do not die with the process that owns the engine: a SIGKILLed kvmesh worker
left ``VLLM::EngineCore``, ``VLLM::Worker`` and a resource tracker running, reparented to PID 1 (docs/vllm-cpu.md).
A daemon thread in each vLLM process checks every ``LIFELINE_POLL_S`` whether its parent is still the process that
started it; when not (the parent died: the child was reparented), it removes the owner's private directory of
vLLM ipc sockets (``VLLM_RPC_BASE_PATH``, ``RUNTIME_DIR_ENV``) if the owner is gone, SIGKILLs its own children and
then itself. The engine core's parent is the kvmesh worker; the model worker's parent is the engine core, so a
SIGKILLed kvmesh worker takes both down within about two polls. A thread rather than ``PR_SET_PDEATHSIG``: that
signal follows the parent *thread*, and vLLM's engine is built on a thread of the worker's executor.

**Prefix drop.** ``OwnedScheduler.kvmesh_drop_blocks`` evicts the cached blocks of given hashes that no request
holds, through the KV cache manager's ``evict_blocks`` (what vLLM's scheduler itself calls for blocks whose KV load
failed): each block loses its hash, stays free, and vLLM publishes ``BlockRemoved``. vLLM's client API has no such
call (only ``reset_prefix_cache``, all or nothing), so ``install_engine_core_utility`` adds a method of that name to
the engine core (the engine-core process only), which the adapter calls as vLLM calls its own utilities
(``call_utility_async``: a method looked up by name on the engine core, run between two engine steps). It publishes
the ``BlockRemoved`` events itself: vLLM publishes its queued events at the end of a step, and an idle engine runs
none, so the router would otherwise learn of the drop only with the engine's next request.

**Quick exit.** Both hooks also freeze the garbage collector's heap when their process starts to exit
(``freeze_heap_at_exit``): without it, an engine shutdown took 5 s, most of it two interpreters walking vLLM's
import heap while they finalized, and vLLM SIGKILLed the engine core that was still at it.

**Sampler continuation.** A seeded request's randomness in vLLM 0.32 is a ``torch.Generator`` seeded with the
request's seed when the request joins the model runner's batch (``GPUModelRunner._update_states``); the CPU sampler
(``TopKTopPSampler.forward_cpu``) then draws one ``torch.randint(0, 2**31, (1,))`` from it per sampled token and
derives that token's Gumbel noise from the draw. A request continued on another engine (migration by recompute, a
failover) with ``n`` outputs already produced carries ``extra_args[SAMPLER_DRAWS_KEY] = n``: right after the request
joins the batch, its generator draws ``n`` such values, so it stands where the original one stood and the
continuation samples exactly what the unmoved request would have (tests/integration/test_vllm_migration.py). Greedy
requests have no generator and need nothing. Only the default CPU sampling path is replayed: with
``use_fp64_gumbel`` (exponential noise over the whole vocabulary per token) the hook declines and says so.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import signal
import threading
import time
from typing import Any

import torch
from vllm.v1.core.sched.scheduler import Scheduler

from .config import DROP_UTILITY, OWNER_PID_ENV, RUNTIME_DIR_ENV, SAMPLER_DRAWS_KEY

logger = logging.getLogger(__name__)

LIFELINE_POLL_S = 0.25

_lifeline_started = False
_exit_freeze_registered = False


def start_lifeline(role: str) -> bool:
    """Die with the parent (module docstring). Only in a vLLM child of a kvmesh worker (``OWNER_PID_ENV`` set and
    not this process); once per process. True when started."""
    global _lifeline_started
    owner = int(os.environ.get(OWNER_PID_ENV, "0") or 0)
    if _lifeline_started or not owner or owner == os.getpid():
        return False
    _lifeline_started = True
    parent = os.getppid()
    runtime_dir = os.environ.get(RUNTIME_DIR_ENV, "")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LIFELINE_POLL_S)
        # The engine core's parent is the owner itself: its parent going means the owner is gone (perhaps still a
        # zombie its supervisor has not reaped). The model worker asks.
        if runtime_dir and (parent == owner or not _alive(owner)):
            shutil.rmtree(runtime_dir, ignore_errors=True)
        _kill_children()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"kvmesh-lifeline-{role}", daemon=True).start()
    logger.info("kvmesh lifeline: %s (pid %d) dies with its parent %d", role, os.getpid(), parent)
    return True


def freeze_heap_at_exit() -> bool:
    """Freeze the cyclic garbage collector's heap when this process starts to exit (``atexit``); once per process.
    True when registered now.

    What it saves: a process that imported vLLM and torch holds ~640 k tracked objects, and the collections the
    interpreter runs while it finalizes walk all of them again: measured on the 2-core machine, exiting after ``import
    vllm.v1.engine.core`` took 2.45 and 2.75 s, 0.30 and 0.32 s with the heap frozen. vLLM's own ``EngineCore.shutdown``
    unfreezes the heap it froze at start-up (so an in-process engine can free its memory) and re-freezes it only on
    ROCm; its model worker never freezes. So on a CPU the model worker took ~3-4 s to exit after vLLM told it to, the
    engine core as long again, and ``AsyncLLM.shutdown`` gave up on the engine core after its 5 s and SIGKILLed it: an
    engine shutdown took 5.0 s (3 of 3 measured). With both frozen at exit it took 2.2 s and the engine core exits by
    itself (tests/integration/test_vllm_disagg.py checks its exit code). Freezing at exit frees nothing less: the
    process's memory goes back with the process, and the atexit handlers registered before this one (vLLM's,
    multiprocessing's) still run after it (atexit runs the last registered first).
    """
    global _exit_freeze_registered
    if _exit_freeze_registered:
        return False
    _exit_freeze_registered = True
    atexit.register(gc.freeze)
    return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_children() -> None:
    try:
        import psutil  # a vLLM dependency
    except ImportError:
        return
    with contextlib.suppress(Exception):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()


def install_engine_core_utility() -> bool:
    """Give vLLM's engine core the ``DROP_UTILITY`` method (it asks its scheduler); True when added now."""
    from vllm.v1.engine.core import EngineCore

    if hasattr(EngineCore, DROP_UTILITY):
        return False

    def kvmesh_drop_blocks(self: Any, event_hashes: Any) -> tuple[int, int]:
        drop = getattr(self.scheduler, DROP_UTILITY, None)
        if drop is None:
            raise RuntimeError(f"the engine core's scheduler {type(self.scheduler).__name__} is not kvmesh's")
        return drop(event_hashes)  # type: ignore[no-any-return]

    setattr(EngineCore, DROP_UTILITY, kvmesh_drop_blocks)
    return True


class OwnedScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, in an engine-core process that dies with the kvmesh worker that owns it, and that can evict
    a prefix's free cached blocks (``kvmesh_drop_blocks``, module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        start_lifeline("engine-core")
        freeze_heap_at_exit()
        install_engine_core_utility()
        super().__init__(*args, **kwargs)

    def kvmesh_drop_blocks(self, event_hashes: Any) -> tuple[int, int]:
        """Evict the cached blocks whose hashes, as vLLM's KV events name them (``maybe_convert_block_hash``: 64-bit
        ints by default), are in ``event_hashes``, where no request holds any copy of the hash; ``(hashes evicted,
        hashes kept because a request holds them)``. Scans every block of the pool (a Python loop over
        ``num_gpu_blocks``): a drop is a rare, cold action, run between two engine steps."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        want = set(event_hashes)
        pool = self.kv_cache_manager.block_pool
        free: dict[Any, list[int]] = {}
        held: set[Any] = set()
        for block in pool.blocks:
            key = block.block_hash
            if key is None or get_group_id(key) != 0:
                continue
            h = maybe_convert_block_hash(get_block_hash(key))
            if h not in want:
                continue
            if block.ref_cnt > 0:
                held.add(h)
            else:
                free.setdefault(h, []).append(block.block_id)
        evict = {block_id for h, ids in free.items() if h not in held for block_id in ids}
        if evict:
            self.kv_cache_manager.evict_blocks(evict)
            # vLLM publishes the KV events it queued at the end of its next step, and an idle engine takes none:
            # published now, as that step would (the same queue, so their order is kept), routers forget the holder
            # at once rather than with the next request.
            events: Any = self.kv_cache_manager.take_events()  # KVCacheEvents, as vLLM's own step passes them
            if events:
                from vllm.distributed.kv_events import KVEventBatch

                self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return len([h for h in free if h not in held]), len(held)


def install_sampler_continuation(runner_cls: type) -> bool:
    """Wrap ``runner_cls._update_states`` so that a new request carrying ``SAMPLER_DRAWS_KEY`` has its generator
    advanced past the draws its earlier engine made (module docstring). True when installed (or already)."""
    if getattr(runner_cls, "_kvmesh_sampler_continuation", False):
        return True
    original = getattr(runner_cls, "_update_states", None)
    if original is None:
        logger.warning("kvmesh: %s has no _update_states; seeded continuations will not be exact", runner_cls)
        return False

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            params = getattr(new, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            draws = extra.get(SAMPLER_DRAWS_KEY)
            if not draws:
                continue
            state = self.requests.get(new.req_id)
            generator = getattr(state, "generator", None)
            if generator is not None:
                torch.randint(0, 2**31, (int(draws),), generator=generator, dtype=torch.long)
        return result

    runner_cls._update_states = _update_states  # type: ignore[attr-defined]
    runner_cls._kvmesh_sampler_continuation = True  # type: ignore[attr-defined]
    return True


class KvmeshWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); its methods are callable through ``collective_rpc``."""

    def kvmesh_install_hooks(self) -> dict[str, Any]:
        """Start this model-worker process's lifeline and install the sampler continuation; says what it did."""
        runner = getattr(self, "model_runner", None)
        sampler = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
        fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
        installed = False
        if runner is not None and not fp64:
            installed = install_sampler_continuation(type(runner))
        elif fp64:
            logger.warning("kvmesh: use_fp64_gumbel sampling is not replayed; seeded continuations will not be exact")
        freeze_heap_at_exit()
        return {"pid": os.getpid(), "lifeline": start_lifeline("model-worker"), "sampler_continuation": installed}
