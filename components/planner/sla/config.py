"""The SLA planner's knobs: one pydantic model, ``SlaPlannerConfig``; ``kvmesh planner --mode sla`` flags are derived
from it (components/runtime/flags.py) as ``PlannerConfig``'s are, so every default lives here once. Units are in each
description (Dynamo's names carry none, and STYLE.md habit 8 keeps a seed system's names).

Where the names and defaults come from
---------------------------------------
Dynamo's SLA planner, ``components/src/dynamo/planner/defaults.py`` (``BasePlannerDefaults``,
``SLAPlannerDefaults``) in ai-dynamo/dynamo at commit 01127723, and its flag names in
``components/planner/src/dynamo/planner/utils/planner_argparse.py`` (seen in the fork wxsms/dynamo at 107ffa33):
``--ttft`` 500 ms, ``--itl`` 50 ms, ``--max-gpu-budget`` 8, ``--min-endpoint`` 1 (for each pool),
``--prefill-engine-num-gpu`` / ``--decode-engine-num-gpu`` 1, ``--no-correction`` off, ``--no-operation`` off,
``--profile-results-dir``, ``--load-predictor`` and ``--adjustment-interval``. Where we differ:

* ``adjustment_interval`` 30 s, not Dynamo's 180 s: the issue's first benchmark load is Dynamo's own sinusoid with a
  150 s period, which a 180 s interval cannot follow at all (one decision per period and a fifth); 30 s gives five
  decisions a period, and equals the load planner's interval, so the two are compared on the same cadence.
* ``load_predictor`` ``kalman``, not Dynamo's ``arima``: ARIMA and Prophet need third-party libraries a planner
  policy may not import (components/planner/sla/predictors.py); of ours, ``constant`` is one interval late on any
  change (two with a 30 s start-up), and ``holt-winters`` needs a season length only the operator knows
  (``load_predictor_season``); the Kalman filter follows a trend or a burst from its second interval without one.
* ``load_prediction_window_size`` (Dynamo: 50 samples, the window its ARIMA and Prophet refit on) is not kept: our
  predictors are recursive (one state updated per interval), so there is no window to size.
* ``profile_results_dir`` default None (Dynamo: ``profiling_results``, required): the workers announce their step-time
  models (``FleetInstance.perf``), so a profile is optional; given, it is a ``kvmesh profile`` JSON file or a
  directory holding one (read by the caller: the controller does no I/O and takes the model as ``perf``).

Ours, with no Dynamo counterpart: ``metric_pulling_interval`` (the fast loop's cadence, 1 s as the load planner's),
``scale_down_sensitivity`` (0.8: Dynamo PR 9294's ``load_scaling_down_sensitivity``), ``worker_startup_s`` (the
start-up lead, 30 s until the measured value is recorded: the issue's benchmark runs both), ``queue_wait`` (the M/D/1
queue wait in prefill sizing, on: the fix for ai-dynamo/dynamo issue 10528), ``min_gpu_budget`` (the load planner's
name; 0: no minimum beyond ``min_endpoint``), ``load_predictor_season``.

This module imports only the standard library and pydantic.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoadPredictorName(enum.StrEnum):
    CONSTANT = "constant"
    HOLT_WINTERS = "holt-winters"
    KALMAN = "kalman"


class SlaPlannerConfig(BaseModel):
    """How the SLA planner decides: latency targets, its two loops' cadences, the load predictor, the GPU budget."""

    model_config = ConfigDict(extra="forbid")

    ttft: float = Field(
        default=500.0,
        gt=0,
        description="Time-to-first-token target in milliseconds: the mean TTFT, queue wait included, that the prefill "
        "pool (or an aggregated pool) is sized to keep under.",
    )
    itl: float = Field(
        default=50.0,
        gt=0,
        description="Inter-token latency target in milliseconds: the decode step time the decode pool (or an "
        "aggregated pool) is sized to keep under.",
    )
    adjustment_interval: float = Field(
        default=30.0,
        gt=0,
        description="Seconds between throughput decisions: each one observes the interval's request reports, "
        "predicts the next intervals' load and sizes the pools (Dynamo's default is 180 s; 30 s follows a 150 s "
        "sinusoid).",
    )
    metric_pulling_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between pulls of the fleet view: the fast loop, which raises a pool above the throughput "
        "loop's size when its workers' predicted TTFT or ITL (from their load reports) breaks the target.",
    )
    load_predictor: LoadPredictorName = Field(
        default=LoadPredictorName.KALMAN,
        description="How the next intervals' request rate, prompt length and output length are predicted: constant "
        "(the last interval's), holt-winters (level, trend and a season of --load-predictor-season intervals), kalman "
        "(level and trend; follows bursts).",
    )
    load_predictor_season: int | None = Field(
        default=None,
        ge=2,
        description="holt-winters only: the load's period in adjustment intervals (e.g. 5 for a 150 s period at "
        "30 s); unset: no seasonal part (Holt's linear trend).",
    )
    no_correction: bool = Field(
        default=False,
        description="Do not correct the performance model by the observed over predicted TTFT and ITL (factors stay "
        "1.0).",
    )
    max_gpu_budget: int = Field(
        default=8,
        ge=1,
        description="Most GPUs all prefill and decode workers together may use. A wanted fleet over it is cut, both "
        "pools by the same fraction, and a swap at full budget removes before it adds.",
    )
    min_gpu_budget: int = Field(
        default=0,
        ge=0,
        description="Fewest GPUs the fleet keeps in all (workers are added to reach it); 0: none beyond "
        "--min-endpoint.",
    )
    min_endpoint: int = Field(
        default=1,
        ge=1,
        description="Fewest workers in each pool (prefill, decode or aggregated).",
    )
    profile_results_dir: str | None = Field(
        default=None,
        description="A `kvmesh profile` JSON file, or a directory holding one, to size pools with; unset: each pool's "
        "workers' announced step-time models.",
    )
    prefill_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one prefill worker uses, for the budget, unless the deployment says (a graph group's "
        "gpus_per_replica).",
    )
    decode_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one decode (or aggregated) worker uses, for the budget, unless the deployment says (a graph "
        "group's gpus_per_replica).",
    )
    scale_down_sensitivity: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="A pool loses a worker only if every survivor, carrying N/(N-1) of the load, stays under this "
        "fraction of each target (KV capacity, TTFT, ITL).",
    )
    worker_startup_s: float = Field(
        default=30.0,
        ge=0,
        description="Seconds from asking for a worker to its serving; the throughput loop asks that far ahead of the "
        "predicted need.",
    )
    queue_wait: bool = Field(
        default=True,
        description="Size prefill so that the mean TTFT including M/D/1 queue wait meets --ttft (off: only one "
        "prompt's own prefill time, as Dynamo, which never scaled under load in its issue 10528).",
    )
    no_operation: bool = Field(
        default=False,
        description="Observe and report what the planner would do (logs, TensorBoard, metrics), and change nothing.",
    )

    @model_validator(mode="after")
    def _check(self) -> SlaPlannerConfig:
        if self.metric_pulling_interval > self.adjustment_interval:
            raise ValueError(
                f"metric_pulling_interval ({self.metric_pulling_interval} s) must not exceed adjustment_interval "
                f"({self.adjustment_interval} s): an interval needs at least one pull"
            )
        if self.min_gpu_budget > self.max_gpu_budget:
            raise ValueError(
                f"min_gpu_budget ({self.min_gpu_budget}) must not exceed max_gpu_budget ({self.max_gpu_budget})"
            )
        if self.min_endpoint * self.decode_engine_num_gpu > self.max_gpu_budget:
            raise ValueError(
                f"min_endpoint ({self.min_endpoint}) decode workers of {self.decode_engine_num_gpu} GPU(s) do not fit "
                f"max_gpu_budget ({self.max_gpu_budget})"
            )
        if self.load_predictor_season is not None and self.load_predictor != LoadPredictorName.HOLT_WINTERS:
            raise ValueError(
                f"load_predictor_season is for load_predictor holt-winters, not {self.load_predictor.value}"
            )
        return self

    @property
    def ttft_s(self) -> float:
        return self.ttft / 1e3

    @property
    def itl_s(self) -> float:
        return self.itl / 1e3
