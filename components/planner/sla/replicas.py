"""How many prefill and decode workers a predicted load needs to meet the TTFT and inter-token-latency targets: the
SLA planner's throughput loop, as two pure functions over a ``components.perf.PerfModel`` (a measured ``Profile`` or
the analytic ``StepTimeModel``).

Prefill (``prefill_workers``)
-----------------------------
One prompt of ``isl`` tokens alone on an idle worker takes ``S = correction x chunked_prefill_ms(isl)`` (chunks of
``max_num_batched_tokens``). ``correction`` is observed over predicted latency (1.0: trust the model); it scales
the model's time everywhere, so a worker measured 20% slower than its profile also prefills 20% fewer tokens/s.
One worker's prefill throughput at that prompt length is ``isl / S`` tokens/s, and::

    workers = ceil(requests_per_s x isl / (rho x isl / S)) = ceil(requests_per_s x S / rho)

with ``rho`` = 1 by default (a worker may be busy all the time). If ``S`` alone is over the TTFT target no pool
size meets it; the detail says so (``target_met`` False) and the count is still the throughput-based one, since
fewer workers would only add queueing on top.

``queue_wait=True`` (our addition, for issue 10528's failure: a TTFT model without queue wait never scaled prefill
under a 1-24 requests/s sinusoid) also keeps the *mean* TTFT including queue wait within target: with Poisson
arrivals spread evenly over the workers and a fixed service time ``S`` each worker is an M/D/1 queue, whose mean
wait at utilisation ``rho`` is ``rho S / (2 (1 - rho))``; ``wait + S <= T`` gives the largest utilisation
``rho = 2 (T - S) / (2T - S)`` (T the TTFT target; 1 at S = 0, 0 at S = T). Example: S = 0.17 s, T = 0.5 s:
rho = 0.66 / 0.83 = 0.795.

Decode (``decode_workers``)
---------------------------
A worker decoding ``b`` sequences, each a prompt of ``isl`` plus on average half its ``osl`` output (a sequence is
between 0 and ``osl`` tokens into its output, uniformly over its life), attends to ``kv = b x (isl + osl / 2)`` KV
tokens. Its step takes ``correction x decode_ms(b, kv)``, which is the inter-token latency each sequence sees. The
best batch is the largest ``b <= max_batch`` (and, if ``kv_capacity_tokens`` is given, with ``kv`` within it) whose
corrected step is within the ITL target; the worker then emits ``b / step_s`` output tokens/s, and::

    workers = ceil(requests_per_s x osl / (b / step_s))

Every ``b`` up to ``max_batch`` is tried (not a bisection), since a measured profile need not be monotone in ``b``.
If even ``b = 1`` misses the target, the detail says so and ``b = 1`` is used (its throughput is the most one can
count on). ``max_batch`` defaults to 1024, vLLM's default ``--max-num-seqs`` for its OpenAI server on GPUs of 70 GiB
or more other than the A100 (``EngineArgs.get_batch_defaults``; 256 on smaller GPUs): the H100 class that
``components.perf``'s default model and its 8192-token budget (the same vLLM branch) describe. Pass the engine's own
``--max-num-seqs`` where it is set.

Both never return fewer than 1 worker (a pool at 0 cannot serve the first request), and take ``ceil`` with a 1e-9
slack so that a load of exactly 2.0 workers' worth, computed as 2.0000000001, asks for 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from components.perf.profile import PerfModel

__all__ = ["DEFAULT_MAX_BATCH", "Sizing", "decode_workers", "prefill_workers", "workers_for"]

DEFAULT_MAX_BATCH = 1024  # vLLM's default --max-num-seqs on >= 70 GiB GPUs (H100 class; 256 on smaller ones)
_CEIL_SLACK = 1e-9


@dataclasses.dataclass(frozen=True, slots=True)
class Sizing:
    """One pool's size for a predicted load, with why and the numbers."""

    pool: str  # "prefill" or "decode"
    workers: int
    target_met: bool  # False: even an idle worker misses the latency target (the count is throughput-based)
    reason: str
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def workers_for(demand: float, per_worker: float) -> int:
    """``ceil(demand / per_worker)`` with a 1e-9 relative slack, at least 1."""
    if per_worker <= 0:
        raise ValueError(f"per-worker throughput must be positive, got {per_worker}")
    need = demand / per_worker
    return max(1, math.ceil(need * (1 - _CEIL_SLACK)))


def _check(name: str, v: float, positive: bool = False) -> None:
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v}")


def prefill_workers(
    requests_per_s: float,
    isl: float,
    perf: PerfModel,
    ttft_target_s: float,
    correction: float = 1.0,
    *,
    queue_wait: bool = False,
) -> tuple[int, Sizing]:
    """Prefill workers for ``requests_per_s`` prompts of ``isl`` tokens within ``ttft_target_s`` (module
    docstring); ``queue_wait`` also keeps the M/D/1 mean queue wait within the target."""
    _check("requests_per_s", requests_per_s)
    _check("isl", isl)
    _check("ttft_target_s", ttft_target_s, positive=True)
    _check("correction", correction, positive=True)
    n = max(1, round(isl))
    prefill_s = correction * perf.chunked_prefill_ms(n) / 1e3
    throughput = n / prefill_s  # tokens/s of one worker busy all the time
    met = prefill_s <= ttft_target_s
    if queue_wait and met:
        t = ttft_target_s
        rho = 2 * (t - prefill_s) / (2 * t - prefill_s)
    else:
        rho = 1.0
    demand = requests_per_s * n  # prompt tokens/s
    metrics: dict[str, float] = {
        "requests_per_s": requests_per_s,
        "isl": float(n),
        "correction": correction,
        "prefill_s": prefill_s,
        "ttft_target_s": ttft_target_s,
        "worker_tokens_per_s": throughput,
        "max_utilisation": rho,
        "demand_tokens_per_s": demand,
    }
    if rho <= 0:  # S == T exactly with queue_wait: any load queues past the target; count as if busy all the time
        rho = 1.0
        metrics["max_utilisation"] = rho
    workers = workers_for(demand, rho * throughput)
    metrics["workers"] = float(workers)
    if met:
        reason = (
            f"{demand:.0f} prompt tokens/s over {rho * throughput:.0f} per worker "
            f"({n} tokens in {prefill_s * 1e3:.1f} ms{f', at most {rho:.0%} busy for queue wait' if rho < 1 else ''})"
            f": {workers}"
        )
    else:
        reason = (
            f"one {n}-token prompt alone takes {prefill_s * 1e3:.1f} ms, over the {ttft_target_s * 1e3:.0f} ms TTFT "
            f"target at any pool size; sized on throughput: {demand:.0f} prompt tokens/s over {throughput:.0f} "
            f"per worker: {workers}"
        )
    return workers, Sizing("prefill", workers, met, reason, metrics)


def decode_workers(
    requests_per_s: float,
    isl: float,
    osl: float,
    perf: PerfModel,
    itl_target_s: float,
    correction: float = 1.0,
    max_batch: int = DEFAULT_MAX_BATCH,
    *,
    kv_capacity_tokens: float | None = None,
) -> tuple[int, Sizing]:
    """Decode workers for ``requests_per_s`` requests of ``isl`` prompt and ``osl`` output tokens within
    ``itl_target_s`` between tokens (module docstring)."""
    _check("requests_per_s", requests_per_s)
    _check("isl", isl)
    _check("osl", osl)
    _check("itl_target_s", itl_target_s, positive=True)
    _check("correction", correction, positive=True)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    context = isl + osl / 2  # mean KV tokens of one sequence over its decode
    best_b, best_step_s = 1, correction * perf.decode_ms(1, context) / 1e3
    met = best_step_s <= itl_target_s
    if met:
        for b in range(2, max_batch + 1):
            if kv_capacity_tokens is not None and b * context > kv_capacity_tokens:
                break  # more sequences would not fit; larger b only adds KV
            step_s = correction * perf.decode_ms(b, b * context) / 1e3
            if step_s <= itl_target_s:
                best_b, best_step_s = b, step_s
    per_worker = best_b / best_step_s  # output tokens/s of one worker
    demand = requests_per_s * osl
    workers = workers_for(demand, per_worker)
    metrics: dict[str, float] = {
        "requests_per_s": requests_per_s,
        "isl": isl,
        "osl": osl,
        "correction": correction,
        "itl_target_s": itl_target_s,
        "batch": float(best_b),
        "context_tokens": context,
        "kv_tokens": best_b * context,
        "step_s": best_step_s,
        "worker_tokens_per_s": per_worker,
        "demand_tokens_per_s": demand,
        "workers": float(workers),
    }
    if met:
        reason = (
            f"{demand:.0f} output tokens/s over {per_worker:.0f} per worker (batch {best_b} at "
            f"{best_b * context:.0f} KV tokens, {best_step_s * 1e3:.2f} ms a step): {workers}"
        )
    else:
        reason = (
            f"one sequence alone steps in {best_step_s * 1e3:.2f} ms, over the {itl_target_s * 1e3:.0f} ms ITL target "
            f"at any pool size; sized on batch 1: {demand:.0f} output tokens/s over {per_worker:.0f} per worker: "
            f"{workers}"
        )
    return workers, Sizing("decode", workers, met, reason, metrics)
