"""The simulated vLLM engine (what Dynamo's ``dynamo.mocker`` is to Dynamo): real scheduling and KV bookkeeping,
modelled step times, pseudo-random but deterministic output tokens.

* ``config``: ``MockEngineConfig``, every knob and the step-time model's sources;
* ``block_pool``: reference-counted paged KV blocks with a prefix cache and KV events (pure);
* ``perf_model``: the step-time polynomial (pure);
* ``scheduler``: vLLM-V1-style continuous batching, chunked prefill, preemption by recompute (pure);
* ``engine``: ``MockEngine``, the asyncio step loop behind the ``Engine`` protocol.
"""

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
