"""The simulated vLLM engine (what Dynamo's ``dynamo.mocker`` is to Dynamo): real scheduling and KV bookkeeping,
modelled step times, pseudo-random but deterministic output tokens.

* ``config``: ``MockEngineConfig``, every knob and the step-time model's sources;
* ``block_pool``: reference-counted paged KV blocks with a prefix cache and KV events (pure);
* ``perf_model``: the step-time polynomial (pure);
* ``scheduler``: vLLM-V1-style continuous batching, chunked prefill, preemption by recompute (pure);
* ``engine``: ``MockEngine``, the asyncio step loop behind the ``Engine`` protocol.

The names are loaded on first use (PEP 562 ``__getattr__``): a graph file's worker group is ``MockEngineConfig``
(components/workers/config.py), so loading a graph imported the engine and its scheduler through an eager
``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .block_pool import BlockPool, NoFreeBlocksError
    from .config import MockEngineConfig
    from .engine import MockEngine
    from .scheduler import DuplicateRequestError, PromptTooLongError, Request, RequestStatus, Scheduler, StepOutput

__all__ = [
    "BlockPool",
    "DuplicateRequestError",
    "MockEngine",
    "MockEngineConfig",
    "NoFreeBlocksError",
    "PromptTooLongError",
    "Request",
    "RequestStatus",
    "Scheduler",
    "StepOutput",
]

# Each public name and the module that defines it (tests/unit/test_lazy_packages.py checks this).
_WHERE = {
    **dict.fromkeys(("BlockPool", "NoFreeBlocksError"), f"{__name__}.block_pool"),
    "MockEngineConfig": f"{__name__}.config",
    "MockEngine": f"{__name__}.engine",
    **dict.fromkeys(
        ("DuplicateRequestError", "PromptTooLongError", "Request", "RequestStatus", "Scheduler", "StepOutput"),
        f"{__name__}.scheduler",
    ),
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
