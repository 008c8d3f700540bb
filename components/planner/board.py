"""``PlannerBoard``: the planner's TensorBoard event files, written by the live planner (loop.py) and by the
simulated one (``kvmesh simulate``), so that a live and a simulated run open side by side with the same tags.

Imports this package's policy and, when a board is made, tensorboardX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from components.planner.policy import Adjustment, Observation, Pool, PullFigures
from components.planner.sla.figures import SlaFigures


class PlannerBoard:
    """TensorBoard scalars and text for ``tensorboard --logdir DIR``. Tags:

    ``pull/*`` at every pull (step = pull number): kv_usage, prefill_queue_size, prefill_queue_utilisation (absent
    when unknown), running_requests, waiting_requests, decode_workers, prefill_workers, gpus;
    ``adjustment/*`` at every adjustment (same step): the interval's kv_usage, prefill_queue_size and
    prefill_queue_utilisation (when the interval had samples), decode_workers/prefill_workers (the targets), gpus
    (after the decisions), and ``adjustment/decisions`` as text, one line per pool with its reason;
    ``sla/*`` at every pull of the SLA planner (same step): every number of its ``SlaFigures`` by field name
    (observed against predicted request rate, prompt and output length at each throughput decision, observed TTFT and
    ITL, the fast loop's predicted TTFT and ITL, the correction factors, throughput/target/actual pool sizes).
    """

    def __init__(self, log_dir: str) -> None:
        from tensorboardX import SummaryWriter  # imported here: only a planner with --log-dir needs it

        self.log_dir = log_dir
        self._writer = SummaryWriter(logdir=log_dir)

    def pull(
        self, step: int, obs: Observation, figures: PullFigures, running: int, waiting: int, walltime: float
    ) -> None:
        scalars: dict[str, float | None] = {
            "pull/kv_usage": figures.kv_usage,
            "pull/prefill_queue_size": figures.queue_waiting,
            "pull/prefill_queue_utilisation": figures.queue_utilisation,
            "pull/running_requests": running,
            "pull/waiting_requests": waiting,
            "pull/decode_workers": obs.decode.workers,
            "pull/prefill_workers": None if obs.prefill is None else obs.prefill.workers,
            "pull/gpus": figures.gpus,
        }
        self._scalars(scalars, step, walltime)

    def sla(self, step: int, figures: SlaFigures, walltime: float) -> None:
        self._scalars({f"sla/{k}": v for k, v in figures.scalars().items()}, step, walltime)

    def adjustment(self, step: int, adj: Adjustment, walltime: float) -> None:
        decode, prefill = adj.decision(Pool.DECODE), adj.decision(Pool.PREFILL)
        scalars: dict[str, float | None] = {
            "adjustment/kv_usage": None if decode is None else decode.metrics.get("kv_usage"),
            "adjustment/prefill_queue_size": None if prefill is None else prefill.metrics.get("queue_waiting"),
            "adjustment/prefill_queue_utilisation": None
            if prefill is None
            else prefill.metrics.get("queue_utilisation"),
            "adjustment/decode_workers": None if decode is None else decode.target,
            "adjustment/prefill_workers": None if prefill is None else prefill.target,
            "adjustment/gpus": adj.gpus_after,
        }
        self._scalars(scalars, step, walltime)
        lines = [("[no-operation] " if adj.no_operation else "") + d.summary() for d in adj.decisions]
        if adj.note:
            lines.append(f"note: {adj.note}")
        lines.append(f"GPUs {adj.gpus_before} -> {adj.gpus_after}")
        # Markdown: two trailing spaces end a line without starting a paragraph.
        self._writer.add_text("adjustment/decisions", "  \n".join(lines), step, walltime=walltime)

    def _scalars(self, scalars: Mapping[str, float | None], step: int, walltime: float) -> None:
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
