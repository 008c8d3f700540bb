"""``PlannerBoard``: the planner's TensorBoard event files, written by the live planner (loop.py) and by the
simulated one (``kvmesh simulate``), so that a live and a simulated run open side by side with the same tags.

Imports this package's policy and, when a board is made, tensorboardX (without torch: ``summary_writer``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from components.planner.policy import Adjustment, Observation, Pool, PullFigures
from components.planner.sla.figures import SlaFigures

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter


def summary_writer(log_dir: str) -> SummaryWriter:
    """A tensorboardX ``SummaryWriter`` for ``log_dir``, imported without importing torch.

    tensorboardX/writer.py runs ``try: import torch`` when it is imported, only to name ``torch.Tensor`` in its
    annotations (``numpy_compatible``); the scalars and text written here are Python numbers and strings, which it
    turns into numpy arrays whether torch is there or not (x2num.make_np imports torch only for a torch tensor). With
    vLLM's torch installed that import cost ~2.2 s of CPU (``import tensorboardX``: 2.44 s wall, 0.22-0.49 s with
    torch blocked, on the 2-core machine) and several times that on a loaded one, in every planner started with
    ``--log-dir`` and every ``kvmesh simulate`` that writes event files. So, while tensorboardX is first imported,
    ``sys.modules["torch"]`` is None (``import torch`` then raises ModuleNotFoundError, which writer.py catches);
    where torch is already loaded it costs nothing and is left alone. Nothing in the planner imports torch, so no
    other thread's import can meet the blocked name.
    """
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            from tensorboardX import SummaryWriter
        finally:
            if sys.modules.get("torch", False) is None:
                del sys.modules["torch"]
    return SummaryWriter(logdir=log_dir)


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
        self.log_dir = log_dir
        self._writer = summary_writer(log_dir)  # imports tensorboardX: only a planner with --log-dir needs it

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
