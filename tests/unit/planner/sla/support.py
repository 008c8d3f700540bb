"""Builders for the SLA controller's tests: a ``FleetState`` (the in-memory fleet view) fed by hand with workers, their
load reports and the frontends' request reports, and a connector twin that carries out an adjustment's changes the way
the live loop does (``change_started``, the pool resized, ``change_ended``)."""

from __future__ import annotations

from typing import Any

from components.fleet.model import FleetSnapshot
from components.fleet.state import FleetState
from components.perf.model import StepTimeModel
from components.planner.controller import PullOutcome
from components.planner.policy import Pool
from components.planner.sla.controller import SlaController
from components.protocol.messages import LoadSnapshot, PrefillQueueReport, RequestStatsReport

MODEL = "m"
# Prefill 10 ms + 0.04 ms/token (a 1000-token prompt: 50 ms, 20000 tokens/s); decode the defaults,
# 5 ms + 0.02 ms/sequence + 3e-5 ms/KV token.
ROUND = StepTimeModel(prefill_base_ms=10.0, prefill_ms_per_token=0.04, prefill_ms_per_token_sq=0.0)


class Fleet:
    """A model's workers in a ``FleetState``: ``prefill`` and ``decode`` counts (prefill None: aggregated)."""

    def __init__(self, decode: int, prefill: int | None = None, perf: StepTimeModel = ROUND) -> None:
        self.state = FleetState()
        self.perf = perf
        self.next_id = 1
        self.ids: dict[Pool, list[int]] = {Pool.DECODE: []}
        if prefill is not None:
            self.ids[Pool.PREFILL] = []
        self.load: dict[Pool, dict[str, Any]] = {Pool.DECODE: {}, Pool.PREFILL: {}}
        self.queue_waiting = 0  # the shared prefill queue's waiting prompts, as every prefill worker reports it
        self.resize(Pool.DECODE, decode)
        if prefill is not None:
            self.resize(Pool.PREFILL, prefill)

    @property
    def aggregated(self) -> bool:
        return Pool.PREFILL not in self.ids

    def role(self, pool: Pool) -> str:
        return "aggregated" if self.aggregated else str(pool)

    def resize(self, pool: Pool, n: int) -> None:
        ids = self.ids[pool]
        while len(ids) > n:
            ids.pop()
        while len(ids) < n:
            ids.append(self.next_id)
            self.next_id += 1
        members = [
            (i, {"model": MODEL, "block_size": 16, "role": self.role(p), "step_time": self.perf.to_mapping()})
            for p, pids in self.ids.items()
            for i in pids
        ]
        self.state.set_members(MODEL, members)

    def count(self, pool: Pool) -> int:
        return len(self.ids[pool])

    def set_load(self, pool: Pool, **fields: Any) -> None:
        """What every worker of ``pool`` reports from now on (LoadSnapshot fields; the rest 0)."""
        self.load[pool] = fields

    def report_loads(self, now_s: float) -> None:
        """Every worker's load report at ``now_s``; and, disaggregated, every prefill worker's queue report (as
        components/workers/disagg.py publishes it), and no load report from them (as the simulator's)."""
        for i in self.ids.get(Pool.PREFILL, []):
            report = PrefillQueueReport(MODEL, self.queue_waiting, 0, 0.0, 0, 0, busy=False)
            self.state.apply_queue(i, report, now_s)
        for pool, ids in self.ids.items():
            if pool == Pool.PREFILL:
                continue
            f = self.load[pool]
            for i in ids:
                snap = LoadSnapshot(
                    now_s=now_s,
                    kv_usage=f.get("kv_usage", 0.0),
                    # A cache that never bounds the batch (16M tokens), unless a test says otherwise: the sizing
                    # tests derive their batches from the ITL target alone.
                    num_total_blocks=f.get("num_total_blocks", 10**6),
                    num_active_blocks=int(f.get("num_total_blocks", 10**6) * f.get("kv_usage", 0.0)),
                    num_running=f.get("num_running", 0),
                    num_waiting=f.get("num_waiting", 0),
                    num_waiting_prefill_tokens=f.get("num_waiting_prefill_tokens", 0),
                    num_preemptions=0,
                    batch_size=f.get("batch_size", 0),
                    num_kv_tokens=f.get("num_kv_tokens", 0),
                    # Only when a test gives it (None: an engine that does not report its step's chunk).
                    **({"num_prefill_tokens": f["num_prefill_tokens"]} if "num_prefill_tokens" in f else {}),
                )
                self.state.apply_load(i, snap, now_s)

    def requests(
        self,
        now_s: float,
        interval_s: float,
        rate: float,
        isl: int,
        osl: int,
        ttft_s: float | None = None,
        itl_s: float | None = None,
    ) -> None:
        """One frontend's report at ``now_s`` of ``rate`` requests/s over ``interval_s``, each of ``isl`` prompt and
        ``osl`` output tokens (as many finish as arrive), with these mean latencies."""
        n = round(rate * interval_s)
        report = RequestStatsReport(
            model=MODEL,
            interval_s=interval_s,
            requests=n,
            prompt_tokens=n * isl,
            finished=n,
            output_tokens=n * osl,
            ttft_count=n if ttft_s is not None else 0,
            ttft_sum_s=n * ttft_s if ttft_s is not None else 0.0,
            itl_count=n if itl_s is not None else 0,
            itl_sum_s=n * itl_s if itl_s is not None else 0.0,
        )
        self.state.apply_request_stats("frontend-1", report, now_s)

    def snapshot(self, now_s: float) -> FleetSnapshot:
        return self.state.snapshot(now_s)


def pull(ctl: SlaController, fleet: Fleet, now_s: float, apply: bool = True) -> PullOutcome:
    """One pull at ``now_s`` with fresh load reports; ``apply``: carry out its changes at once, as a connector whose
    change completes before the next pull (change_started, resize, change_ended)."""
    fleet.report_loads(now_s)
    out = ctl.pull(fleet.snapshot(now_s))
    if apply and out.adjustment is not None:
        for d in out.adjustment.changes():
            ctl.change_started(d.pool, d.current, d.target)
            fleet.resize(d.pool, d.target)
            ctl.change_ended(d.pool)
    return out
