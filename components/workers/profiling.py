"""Measuring one engine's performance profile (``kvmesh profile``; Dynamo profiles an engine the same way before
deploying it): prefill time by prompt length and decode step time by batch size x context length, each grid point
measured ``repeats`` times after ``warmup`` untimed runs, into a ``components.perf.profile.Profile``.

It drives any ``Engine`` (the simulated ``MockEngine`` or ``VllmEngine``) through ``generate`` only, as a worker does:

* prefill, prompt length ``n``: one request of ``n`` fresh random token ids (so no prefix-cache hit) and
  ``max_tokens=1``, alone on the engine; the time from submitting it to its first token. With ``n`` at most the
  engine's token budget (``max_num_batched_tokens``) that is one step computing ``n`` prompt tokens, plus what the
  engine spends around a step (scheduling, sampling, handing the token over), which a real deployment pays as well.
* decode, ``b`` sequences of context ``c``: ``b`` requests of ``c`` fresh prompt tokens submitted together, each
  generating enough tokens (``ignore_eos``) to stay in the batch while the one whose first token came last (every
  other one is decoding by then) has ``warmup_steps`` intervals between its tokens skipped and the next
  ``decode_steps`` timed: each interval is one step decoding all ``b``. A run's sample is the median of its
  intervals. The context a measured step attends to grows by one token a step: interval ``k`` (between output
  tokens ``k`` and ``k + 1``) computes output token ``k + 1`` over ``c + k + 1`` tokens, so the grid's context axis
  is stored as the mean over the timed intervals, ``c + warmup_steps + (decode_steps + 1) / 2``.

Time: wall-clock intervals times ``time_scale`` (a ``MockEngine`` with ``speedup_ratio`` s runs s times faster than
the model it simulates, so its times are scaled back by s; 1 for vLLM). The clock is an argument.

Imports ``components.perf`` and the protocol's messages; the engine is passed in (``components.cli.profile`` builds
it), so this module imports no engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from components.perf.model import DEFAULT_MODEL
from components.perf.profile import Profile
from components.protocol.messages import GenerateRequest, SamplingParams
from components.workers.engines.base import Engine

__all__ = ["ProfileGrid", "profile_engine"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    """What to measure. The defaults finish in ~10-20 s for the simulated engine at speedup 4 on a 2-core machine."""

    prompt_tokens: Sequence[int] = (128, 512, 1024, 2048, 4096)  # prefill grid, tokens
    batch_sizes: Sequence[int] = (1, 4, 16)  # decode grid, sequences
    context_tokens: Sequence[int] = (256, 1024, 2048)  # decode grid, prompt tokens of each sequence
    repeats: int = 3  # timed runs per grid point
    warmup: int = 1  # untimed runs per grid point (prefill) / before the decode grid
    warmup_steps: int = 2  # decode intervals skipped at the start of each timed run
    decode_steps: int = 8  # decode intervals timed in each run

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "batch_sizes", "context_tokens"):
            axis = list(getattr(self, name))
            if not axis or any(v < 1 for v in axis) or sorted(set(axis)) != axis:
                raise ValueError(f"{name} must be positive, ascending and without repeats, got {axis}")
        if self.repeats < 1 or self.warmup < 0 or self.warmup_steps < 0 or self.decode_steps < 1:
            raise ValueError("repeats and decode_steps must be >= 1, warmup and warmup_steps >= 0")


class _Prompts:
    """Fresh random prompts (ids in ``[low, vocab_size)``): no two share a first block, so nothing is cached."""

    def __init__(self, vocab_size: int, seed: int, low: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.low = low
        self.count = 0

    def request(self, n: int, max_tokens: int) -> GenerateRequest:
        self.count += 1
        ids = [self.rng.randrange(self.low, self.vocab) for _ in range(n)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return GenerateRequest(request_id=f"profile-{self.count}", token_ids=ids, sampling=sampling)


async def _arrivals(engine: Engine, request: GenerateRequest, clock: Callable[[], float]) -> list[float]:
    """The clock at each output token of ``request`` (a chunk of k tokens counts k times at its arrival)."""
    out = []
    async for chunk in engine.generate(request):
        now = clock()
        out += [now] * max(1, len(chunk.token_ids))
    return out


async def _prefill_once(engine: Engine, prompts: _Prompts, n: int, clock: Callable[[], float]) -> float:
    request = prompts.request(n, 1)
    start = clock()
    async for _chunk in engine.generate(request):
        return clock() - start
    raise RuntimeError(f"the engine produced no token for a prompt of {n} tokens")


async def _decode_once(
    engine: Engine, prompts: _Prompts, b: int, c: int, grid: ProfileGrid, budget: int, clock: Callable[[], float]
) -> float:
    # Requests start decoding up to ceil(b * c / budget) steps apart; each generates that many more tokens than
    # the last one needs, so none leaves the batch while the last one's intervals are timed.
    stagger = -(-b * c // budget) + 1
    max_tokens = grid.warmup_steps + grid.decode_steps + 1 + 2 * stagger
    runs = [asyncio.create_task(_arrivals(engine, prompts.request(c, max_tokens), clock)) for _ in range(b)]
    arrivals = await asyncio.gather(*runs)
    last = max(arrivals, key=lambda a: a[0])  # every other sequence is decoding from its first token on
    lo = grid.warmup_steps
    intervals = [t1 - t0 for t0, t1 in zip(last[lo:], last[lo + 1 : lo + 1 + grid.decode_steps], strict=False)]
    if len(intervals) < grid.decode_steps:
        raise RuntimeError(f"decode {b} x {c}: {len(last)} tokens, too few to time {grid.decode_steps} steps")
    return statistics.median(intervals)


async def profile_engine(
    engine: Engine,
    grid: ProfileGrid,
    *,
    max_num_batched_tokens: int,
    vocab_size: int,
    time_scale: float = 1.0,
    seed: int = 0,
    low_token_id: int = 0,
    host_load_ms_per_token: float = DEFAULT_MODEL.host_load_ms_per_token,
    meta: Mapping[str, Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Measure ``engine`` (started; the caller shuts it down) on ``grid``: times in ms, wall time x
    ``time_scale``. Prompt lengths above ``max_num_batched_tokens`` are refused: they would time several steps."""
    if max(grid.prompt_tokens) > max_num_batched_tokens:
        raise ValueError(
            f"prompt length {max(grid.prompt_tokens)} exceeds the engine's token budget {max_num_batched_tokens}: "
            "a prefill grid point must be one step"
        )
    if max(grid.batch_sizes) > max_num_batched_tokens:
        raise ValueError(f"batch size {max(grid.batch_sizes)} exceeds the token budget {max_num_batched_tokens}")
    prompts = _Prompts(vocab_size, seed, low_token_id)
    say = progress or (lambda _s: None)
    scale_ms = time_scale * 1e3
    prefill: list[list[float]] = []
    for n in grid.prompt_tokens:
        for _ in range(grid.warmup):
            await _prefill_once(engine, prompts, n, clock)
        samples = [scale_ms * await _prefill_once(engine, prompts, n, clock) for _ in range(grid.repeats)]
        prefill.append(samples)
        say(f"prefill {n:>6} tokens: median {statistics.median(samples):8.2f} ms")
    decode: list[list[list[float]]] = []
    if grid.warmup:  # the first batch of a fresh engine pays one-off costs (allocations, compilation)
        await _decode_once(
            engine, prompts, grid.batch_sizes[0], grid.context_tokens[0], grid, max_num_batched_tokens, clock
        )
    for b in grid.batch_sizes:
        row = []
        for c in grid.context_tokens:
            samples = [
                scale_ms * await _decode_once(engine, prompts, b, c, grid, max_num_batched_tokens, clock)
                for _ in range(grid.repeats)
            ]
            row.append(samples)
            say(f"decode {b:>4} x {c:>6} tokens: median {statistics.median(samples):8.3f} ms/step")
        decode.append(row)
    offset = grid.warmup_steps + (grid.decode_steps + 1) / 2
    all_meta = {
        "time_scale": time_scale,
        "repeats": grid.repeats,
        "warmup": grid.warmup,
        "warmup_steps": grid.warmup_steps,
        "decode_steps": grid.decode_steps,
        "decode_prompt_tokens": list(grid.context_tokens),
        **(meta or {}),
    }
    return Profile.build(
        prompt_tokens=list(grid.prompt_tokens),
        prefill_samples_ms=prefill,
        batch_sizes=list(grid.batch_sizes),
        context_tokens=[c + offset for c in grid.context_tokens],
        decode_samples_ms=decode,
        max_num_batched_tokens=max_num_batched_tokens,
        host_load_ms_per_token=host_load_ms_per_token,
        meta=all_meta,
    )
