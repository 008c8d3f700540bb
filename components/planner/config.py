"""The planner's decision knobs: one pydantic model, ``PlannerConfig``; ``kvmesh planner`` flags are derived from it
(components/runtime/flags.py), so every default lives here once.

Names and defaults are those of Dynamo's load planner (its ``--adjustment-interval`` 30, ``--metric-pulling-interval``
1, ``--max-gpu-budget`` 8, ``--min-gpu-budget`` 1, the four thresholds 0.9/0.5 and 0.5/0.2, one GPU per engine, as
ai-dynamo/dynamo docs/architecture/load_planner.md lists them at commit 19d1fc5e). Its two intervals carry no unit in
their names; STYLE.md habit 8 keeps a seed system's names, so the unit (seconds) is stated in each description
instead. Both are floats, not Dynamo's ints: the planner benchmark compresses time and scales the intervals with it.

What the thresholds are compared against is defined in ``components/planner/policy.py``'s docstring.

``PlannerRunConfig`` is the rest of ``kvmesh planner``'s own flags: which deployment and model, how pools are resized
(``--environment``), TensorBoard and Prometheus. Both models are also the ``planner:`` section of a graph file
(components/deploy/graph.py derives it from them, less what the graph itself decides), so this module is a leaf any
package may import (tests/unit/test_layering.py: a pure config module).

This module is read by the pure policy (its own package's config, STYLE.md habit 1); it imports only the standard
library and pydantic.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A change to a pool may take this long before it counts as failed: an outside system (virtual) that starts a real
# engine, or a new vLLM worker (local: model load, profiling, CUDA graphs) takes minutes; ten minutes covers it
# without leaving a planner paused forever on a worker that never comes up.
DEFAULT_SCALING_TIMEOUT_S = 600.0


class PlannerConfig(BaseModel):
    """How the planner decides: when it looks, when it acts, the thresholds it acts on and the GPU budget."""

    model_config = ConfigDict(extra="forbid")

    adjustment_interval: float = Field(
        default=30.0,
        gt=0,
        description="Seconds between scaling decisions. Each decision compares the averages of the pulls since the "
        "previous one with the thresholds, and changes each pool by at most one worker.",
    )
    metric_pulling_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between metric pulls (decode workers' KV-cache use, prefill queue size). A worker whose "
        "latest load snapshot is older than 3 pulls is left out of a pull's average.",
    )
    max_gpu_budget: int = Field(
        default=8,
        ge=1,
        description="Most GPUs all prefill and decode workers together may use; a scale-up that would pass it is "
        "refused. A simulated worker counts as its graph group's gpus_per_replica (0 counts as 1).",
    )
    min_gpu_budget: int = Field(
        default=1,
        ge=0,
        description="Fewest GPUs each pool (prefill, decode) keeps; a scale-down that would go under it is refused. "
        "A pool never goes below one worker whatever this says.",
    )
    decode_kv_scale_up_threshold: float = Field(
        default=0.9,
        ge=0,
        description="Add a decode (or aggregated) worker when the interval's average KV-cache use of those workers, "
        "a fraction 0..1 of their KV blocks, is above this.",
    )
    decode_kv_scale_down_threshold: float = Field(
        default=0.5,
        ge=0,
        description="Remove a decode (or aggregated) worker when the interval's average KV-cache use (fraction 0..1) "
        "is below this. Not within 3 intervals of adding one.",
    )
    prefill_queue_scale_up_threshold: float = Field(
        default=0.5,
        ge=0,
        description="Add a prefill worker when prefill queue utilisation, the interval's average number of items "
        "waiting in the prefill queue divided by the number of prefill workers (items per worker), is above this "
        "and the queue's trend does not bring it under this within 3 intervals.",
    )
    prefill_queue_scale_down_threshold: float = Field(
        default=0.2,
        ge=0,
        description="Remove a prefill worker when prefill queue utilisation (average items waiting per prefill "
        "worker over the interval) is below this.",
    )
    decode_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one decode (or aggregated) worker uses, for the budget, unless the deployment says "
        "(a graph group's gpus_per_replica).",
    )
    prefill_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one prefill worker uses, for the budget, unless the deployment says (a graph group's "
        "gpus_per_replica).",
    )
    no_operation: bool = Field(
        default=False,
        description="Observe and report what the planner would do (logs, TensorBoard, metrics), and change nothing.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> PlannerConfig:
        # A down-threshold at or above its up-threshold would make one average both add and remove (or flap every
        # interval): refused rather than silently ordered.
        pairs = (
            ("decode_kv_scale_down_threshold", "decode_kv_scale_up_threshold"),
            ("prefill_queue_scale_down_threshold", "prefill_queue_scale_up_threshold"),
        )
        for down, up in pairs:
            if getattr(self, down) >= getattr(self, up):
                raise ValueError(f"{down} ({getattr(self, down)}) must be below {up} ({getattr(self, up)})")
        if self.min_gpu_budget > self.max_gpu_budget:
            raise ValueError(
                f"min_gpu_budget ({self.min_gpu_budget}) must not exceed max_gpu_budget ({self.max_gpu_budget})"
            )
        if self.metric_pulling_interval > self.adjustment_interval:
            raise ValueError(
                f"metric_pulling_interval ({self.metric_pulling_interval} s) must not exceed adjustment_interval "
                f"({self.adjustment_interval} s): an interval needs at least one pull"
            )
        return self


class Environment(enum.StrEnum):
    LOCAL = "local"  # the circus arbiter `kvmesh serve` started, found through state/<namespace>.json
    VIRTUAL = "virtual"  # an outside system answers through etcd (tests, the fleet simulator)
    KUBERNETES = "kubernetes"  # its own issue: refused for now


class PlannerMode(enum.StrEnum):
    LOAD = "load"  # Dynamo's load planner: KV use and prefill queue thresholds (PlannerConfig)
    SLA = "sla"  # the SLA planner: TTFT and ITL targets ahead of the predicted load (planner/sla/config.py)


class PlannerRunConfig(BaseModel):
    """Where the planner runs: the deployment, its model, how it changes the fleet and where it reports."""

    model_config = ConfigDict(extra="forbid")

    mode: PlannerMode = Field(
        default=PlannerMode.LOAD,
        description="Which planner: load (Dynamo's load planner: KV-cache use and prefill queue thresholds, one worker "
        "a step) or sla (TTFT and ITL targets: predicts the load, sizes each pool from the performance model ahead of "
        "the worker start-up, scales down only when the survivors stay within target). Flags of the other mode are "
        "refused; the flags both share (--adjustment-interval, --metric-pulling-interval, --max-gpu-budget, "
        "--min-gpu-budget, --prefill/decode-engine-num-gpu, --no-operation) take the chosen mode's defaults.",
    )

    namespace: str = Field(default="kvmesh", description="Namespace of the deployment to scale.")
    served_model_name: str = Field(
        default="mock-model",
        min_length=1,
        description="Served model name whose workers are scaled (the workers' --model).",
    )
    environment: Environment = Field(
        default=Environment.LOCAL,
        description="How pools are resized: local (the circus arbiter of the `kvmesh serve` deployment of this "
        "namespace, found through <state-dir>/<namespace>.json), virtual (target sizes written to etcd under "
        "kvmesh/<namespace>/planner/virtual/ for an outside system to apply and acknowledge), kubernetes (the "
        "scale of the worker Deployments `kvmesh k8s apply` created in --k8s-namespace).",
    )
    k8s_namespace: str = Field(
        default="default",
        min_length=1,
        description="kubernetes environment: the Kubernetes namespace of the worker Deployments.",
    )
    kubeconfig: str | None = Field(
        default=None,
        description="kubernetes environment: a kubeconfig file; unset: the pod's own service account in a cluster, "
        "else $KUBECONFIG or ~/.kube/config.",
    )
    state_dir: str | None = Field(
        default=None,
        description="local environment: the directory of kvmesh serve's state files; unset: $KVMESH_STATE_DIR, else "
        "./state. etcd and NATS endpoints are read from the state file unless given as flags or in the environment.",
    )
    log_dir: str | None = Field(
        default=None,
        description="Directory for TensorBoard event files (scalars at every pull and adjustment, decisions as "
        "text); none: no TensorBoard output.",
    )
    scaling_timeout_s: float = Field(
        default=DEFAULT_SCALING_TIMEOUT_S,
        gt=0,
        description="Seconds one pool change may take before it counts as failed: local, until a new worker has "
        "registered in etcd (a leaving one gets its watcher's graceful_timeout_s to drain instead); virtual, until "
        "the outside system reports it done; kubernetes, until the Deployment's updated and available replicas "
        "equal the count. Also how long a count changed by hand may take to show in the fleet before the planner "
        "goes on from the workers registered.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address of the planner's Prometheus endpoint (GET /metrics); loopback unless said otherwise.",
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="TCP port of the planner's Prometheus endpoint; 0: a free port, announced on the READY line and "
        "by `kvmesh status` (a fixed default would clash between the planners of two deployments on one machine).",
    )


# --------------------------------------------------------------------------------------------------------------------
# The SLA planner's knobs (``kvmesh planner --mode sla``; components/planner/sla/). Here rather than in the sla package
# so that a graph's ``planner:`` section (components/deploy/graph.py) can hold them: only a package's own pure
# config module may be imported from below it (tests/unit/test_layering.py).
#
# The SLA planner's knobs: one pydantic model, ``SlaPlannerConfig``; ``kvmesh planner --mode sla`` flags are derived
# from it (components/runtime/flags.py) as ``PlannerConfig``'s are, so every default lives here once. Units are in each
# description (Dynamo's names carry none, and STYLE.md habit 8 keeps a seed system's names).
#
# Where the names and defaults come from
# ---------------------------------------
# Dynamo's SLA planner, ``components/src/dynamo/planner/defaults.py`` (``BasePlannerDefaults``,
# ``SLAPlannerDefaults``) in ai-dynamo/dynamo at commit 01127723, and its flag names in
# ``components/planner/src/dynamo/planner/utils/planner_argparse.py`` (seen in the fork wxsms/dynamo at 107ffa33):
# ``--ttft`` 500 ms, ``--itl`` 50 ms, ``--max-gpu-budget`` 8, ``--min-endpoint`` 1 (for each pool),
# ``--prefill-engine-num-gpu`` / ``--decode-engine-num-gpu`` 1, ``--no-correction`` off, ``--no-operation`` off,
# ``--profile-results-dir``, ``--load-predictor`` and ``--adjustment-interval``. Where we differ:
#
# * ``adjustment_interval`` 30 s, not Dynamo's 180 s: the first benchmark load is Dynamo's own sinusoid with a
#   150 s period, which a 180 s interval cannot follow at all (one decision per period and a fifth); 30 s gives five
#   decisions a period, and equals the load planner's interval, so the two are compared on the same cadence.
# * ``load_predictor`` ``kalman``, not Dynamo's ``arima``: ARIMA and Prophet need third-party libraries a planner
#   policy may not import (components/planner/sla/predictors.py); of ours, ``constant`` is one interval late on any
#   change (two with a 30 s start-up), and ``holt-winters`` needs a season length only the operator knows
#   (``load_predictor_season``); the Kalman filter follows a trend or a burst from its second interval without one.
# * ``load_prediction_window_size`` (Dynamo: 50 samples, the window its ARIMA and Prophet refit on) is not kept: our
#   predictors are recursive (one state updated per interval), so there is no window to size.
# * ``profile_results_dir`` default None (Dynamo: ``profiling_results``, required): the workers announce their step-time
#   models (``FleetInstance.perf``), so a profile is optional; given, it is a ``kvmesh profile`` JSON file or a
#   directory holding one (read by the caller with ``components.planner.sla_profile.load_profile_results``: the
#   controller does no I/O and takes the model as ``perf``).
#
# Ours, with no Dynamo counterpart: ``metric_pulling_interval`` (the fast loop's cadence, 1 s as the load planner's),
# ``scale_down_sensitivity`` (0.8: Dynamo PR 9294's ``load_scaling_down_sensitivity``), ``worker_startup_s`` (the
# start-up lead, 30 s until the measured value is recorded: the benchmark runs both), ``queue_wait`` (the M/D/1
# queue wait in prefill sizing, on: the fix for ai-dynamo/dynamo issue 10528), ``min_gpu_budget`` (the load planner's
# name; 0: no minimum beyond ``min_endpoint``), ``load_predictor_season``, ``scale_down_tolerance`` (0.1: the
# Kubernetes HorizontalPodAutoscaler's default tolerance), ``scale_down_window`` (1 interval: the autoscaler's
# scale-down stabilisation window is 5 min; one 30 s interval here keeps the SLA planner's savings on a 150 s period),
# ``itl_correction_deadband`` (0.05: the ITL factor's noise between runs that differ by 2 ms of arrival jitter,
# docs/sla-planner.md "Robust to small input noise").
#
# This module imports only the standard library and pydantic.


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
    load_predictor_warmup_trace: str | None = Field(
        default=None,
        description="A request trace (Mooncake jsonl, Azure csv) whose arrivals, cut into adjustment intervals, "
        "warm-start the predictors (request rate, prompt and output length) before the first live interval, at its "
        "own timestamps (e.g. yesterday's load for today's); unset: the predictors start from the first interval.",
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
    scale_down_window: int = Field(
        default=1,
        ge=0,
        le=20,
        description="A removal goes no lower than what was asked for (the throughput loop's forecast or a fast-loop "
        "raise) over this many previous adjustment intervals: a stabilisation window, in intervals (0: none).",
    )
    scale_down_tolerance: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="A removal is sized for this fraction more than the larger of the predicted and the observed "
        "load (0.1: 10%, the Kubernetes autoscaler's tolerance), so a load whose need sits at a pool-size boundary "
        "does not move the pool up and down on its noise.",
    )
    itl_correction_deadband: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="The ITL correction factor moves the sizing only by how far it is beyond this fraction of 1 "
        "(0.05: a factor within 0.95-1.05 sizes as 1, 1.08 as 1.03): the interval's factor is a sample of the steps "
        "in progress at a few pulls, noisy by a few percent, and the decode sizing's batch is a step function of it "
        "(0: the factor as measured).",
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


# Fields both planners have (the intervals, the GPU budget, --no-operation): one flag each, the chosen mode's default.
SHARED_FIELDS = frozenset(PlannerConfig.model_fields) & frozenset(SlaPlannerConfig.model_fields)

AnyPlannerConfig = PlannerConfig | SlaPlannerConfig


def policy_config(mode: PlannerMode, values: dict[str, Any]) -> AnyPlannerConfig:
    """The decision knobs of ``mode`` from ``values`` (field name -> value, those given): the mode's model, validated.
    A field only the other mode has is refused by name (ValueError), rather than ignored: ``--ttft`` with the load
    planner would otherwise do nothing, silently."""
    own, other = (PlannerConfig, SlaPlannerConfig) if mode == PlannerMode.LOAD else (SlaPlannerConfig, PlannerConfig)
    foreign = sorted(k for k in values if k in other.model_fields and k not in own.model_fields)
    if foreign:
        names = ", ".join(k.replace("_", "-") for k in foreign)
        theirs = PlannerMode.SLA if mode == PlannerMode.LOAD else PlannerMode.LOAD
        raise ValueError(f"{names}: only for mode {theirs.value} (this planner's mode is {mode.value})")
    return own.model_validate({k: v for k, v in values.items() if k in own.model_fields})
