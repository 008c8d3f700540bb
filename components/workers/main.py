"""``kvmesh worker``: run one or more workers in this process until SIGTERM/SIGINT, then drain and exit 0.

    kvmesh worker --engine mock --namespace NS --component backend --model NAME --num-workers 16 --speedup-ratio inf
    kvmesh worker --engine vllm --namespace NS --model-path models/tiny-llama --kv-cache-memory-bytes 67108864

Engine options come from the engine's own config model (``MockEngineConfig``, ``VllmEngineConfig``). A flag both
models have (``--block-size``, ``--max-model-len``, ``--seed``, ...) is registered once and goes to whichever engine
runs, with that engine's default when it is not given; a flag only the other engine has is an error.

vLLM starts its engine processes with ``spawn``, which re-imports ``__main__``: this module, ``components.cli.main``
and the ``kvmesh`` console script keep their ``if __name__ == "__main__"`` guards for that reason. vLLM is imported
only when ``--engine vllm`` runs. SIGTERM is the way to stop a vLLM worker: it drains, then shuts vLLM's engine-core
and model processes down (a SIGKILL would orphan them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from components.perf.errors import ProfileFormatError
from components.perf.profile import Profile
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, run_component
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.base import Engine
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.engines.vllm.config import VllmEngineConfig
from components.workers.worker import Worker

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, WorkerConfig)
    add_model_arguments(p, MockEngineConfig)
    # Only the vLLM flags that do not exist yet: shared names (model_path from WorkerConfig, block_size and friends
    # from MockEngineConfig) are one flag feeding both.
    add_model_arguments(p, VllmEngineConfig, skip=set(WorkerConfig.model_fields) | set(MockEngineConfig.model_fields))


_ENGINE_CONFIGS: dict[EngineKind, type[BaseModel]] = {
    EngineKind.MOCK: MockEngineConfig,
    EngineKind.VLLM: VllmEngineConfig,
}


def check_engine_flags(engine: EngineKind, args: argparse.Namespace) -> None:
    """Refuse flags that only another engine reads: silently ignoring ``--speedup-ratio`` on a vLLM worker (or
    ``--kv-cache-memory-bytes`` on a mock one) would hide a mistake."""
    own = set(_ENGINE_CONFIGS[engine].model_fields)
    for kind, model in _ENGINE_CONFIGS.items():
        foreign = [
            "--" + name.replace("_", "-")
            for name in model.model_fields
            if name not in own and name not in WorkerConfig.model_fields and getattr(args, name, None) is not None
        ]
        if kind != engine and foreign:
            raise SystemExit(f"kvmesh worker --engine {engine}: {', '.join(foreign)} apply only to --engine {kind}")


def resolve_worker_config(cfg: WorkerConfig, args: argparse.Namespace) -> WorkerConfig:
    """For vLLM: the model directory must exist; announce it as an absolute path (frontends started from another
    directory load the tokenizer from it) and serve it under its directory name unless --model was given."""
    if cfg.engine != EngineKind.VLLM:
        return cfg
    if not cfg.model_path:
        raise SystemExit("kvmesh worker --engine vllm needs --model-path DIR (a local Hugging Face model directory)")
    path = Path(cfg.model_path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"kvmesh worker: {path} is not a model directory (no config.json)")
    update: dict[str, str] = {"model_path": str(path)}
    if getattr(args, "model", None) is None:
        update["model"] = path.name
    return cfg.model_copy(update=update)


def make_engine(cfg: WorkerConfig, args: argparse.Namespace, index: int) -> Engine:
    if cfg.engine == EngineKind.MOCK:
        # One seed for the whole fleet: identical requests give identical tokens on every worker.
        return MockEngine(model_from_args(MockEngineConfig, args), name=f"mock-{index}")
    if cfg.engine == EngineKind.VLLM:
        from components.workers.engines.vllm import VllmEngine  # imports no vLLM yet: start() does

        try:
            vcfg = model_from_args(VllmEngineConfig, args, model_path=cfg.model_path)
        except ValidationError as e:
            raise SystemExit(f"kvmesh worker --engine vllm: {e}") from None
        return VllmEngine(vcfg, name=f"vllm-{index}", role=cfg.role)
    raise SystemExit(f"engine {cfg.engine} is not available in this build (supported: mock, vllm)")


def load_profile(path: str) -> Profile:
    """The profile a worker runs with (``--profile``); a missing or malformed file stops the worker with why."""
    try:
        profile = Profile.load(path)
    except (OSError, ProfileFormatError) as e:
        raise SystemExit(f"kvmesh worker --profile: {e}") from None
    logger.info("announcing profile %s (%s): fit %s", profile.profile_id, path, profile.step_time())
    return profile


READY_FILE_ENV = "KVMESH_READY_FILE"


def mark_ready(ready: bool) -> None:
    """Where ``KVMESH_READY_FILE`` names a file (the pods ``kvmesh k8s render`` writes: their readiness probe tests
    it), create it once every worker of the process has registered, and remove it when the process starts draining."""
    path = os.environ.get(READY_FILE_ENV)
    if not path:
        return
    try:
        if ready:
            Path(path).write_text(f"{os.getpid()}\n")
        else:
            Path(path).unlink(missing_ok=True)
    except OSError as e:
        logger.warning("%s=%s: %s", READY_FILE_ENV, path, e)


class WorkerProcess:
    """``num_workers`` workers of one engine kind, as the process kit runs them."""

    def __init__(self, cfg: WorkerConfig, args: argparse.Namespace, runtime: Runtime) -> None:
        self.cfg = cfg
        profile = load_profile(cfg.profile) if cfg.profile else None
        self.workers = [
            Worker(runtime, cfg, make_engine(cfg, args, i), index=i, profile=profile) for i in range(cfg.num_workers)
        ]

    async def start(self) -> str:
        workers = self.workers
        # Every start runs to its end before failures are handled: a vLLM engine still starting in a thread when
        # its sibling fails would otherwise outlive the process as orphaned engine-core processes.
        started = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            raise SystemExit(f"kvmesh worker: {len(failed)} of {len(workers)} workers failed to start: {failed[0]}")
        logger.info("%d %s workers serving %s in %s", len(workers), self.cfg.engine, self.cfg.model, self.cfg.namespace)
        mark_ready(True)
        return f"{len(workers)} workers: " + ",".join(f"{w.instance_id:x}" for w in workers)

    async def ended(self) -> None:
        """Every engine of the process died (each worker already left the fleet)."""
        await asyncio.gather(*(w.dead.wait() for w in self.workers))

    async def stop(self) -> tuple[int, str]:
        workers = self.workers
        mark_ready(False)  # not ready while draining: Kubernetes takes the pod out of its Service's endpoints
        dead = [w for w in workers if w.dead.is_set()]
        logger.info("draining %d workers", len(workers))
        cancelled = sum(await asyncio.gather(*(w.stop() for w in workers)))
        if cancelled:
            logger.warning("%d requests outlived the drain timeout and were cancelled", cancelled)
        if dead and len(dead) == len(workers):
            # Every engine died: exit non-zero, so a supervisor (circus, Kubernetes) starts a fresh worker.
            return 1, f"DEAD {dead[0].dead_reason}"
        return 0, "STOPPED"


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config from its flags; a value the config refuses exits with its flag and why, not a traceback
    (``--role prefill --max-local-prefill-length 512``: only decode workers read the threshold)."""
    try:
        return model_from_args(WorkerConfig, args)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            loc = err["loc"]
            flag = "--" + str(loc[0]).replace("_", "-") if loc else ""
            shown = f" (got {err['input']})" if loc and isinstance(err["input"], str | int | float) else ""
            problems.append(f"{flag}: {msg}{shown}" if flag else msg)
        raise SystemExit("kvmesh worker: " + "; ".join(problems)) from None


def main(args: argparse.Namespace) -> int:
    cfg = worker_config_from_args(args)
    check_engine_flags(cfg.engine, args)
    cfg = resolve_worker_config(cfg, args)
    return eventloop.run(
        run_component(
            args,
            f"kvmesh-worker-{cfg.namespace}",
            lambda runtime: WorkerProcess(cfg, args, runtime),
            drain_timeout_s=cfg.drain_timeout_s,
        )
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvmesh worker")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
