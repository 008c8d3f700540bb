"""The SLA planner's pure core (issue 25): scale the prefill and decode pools to TTFT and inter-token-latency targets
ahead of the load. Pure functions and small classes over numbers and a ``components.perf.PerfModel``: standard
library plus ``components.perf`` only; no I/O, no clock, no asyncio, nothing done at import. The loop, flags,
simulator and benchmark call in here.

* ``predictors``: the next intervals' request count, prompt length and output length (``constant``,
  ``holt-winters``, ``kalman``: ``make_predictor``; ``predict_ahead`` for the start-up lead).
* ``replicas``: the throughput loop's pool sizes: ``prefill_workers`` (one worker's prefill throughput at the prompt
  length within the TTFT target, optionally with M/D/1 queue wait) and ``decode_workers`` (the largest batch within
  the ITL target at the predicted context).
* ``consolidation``: ``consolidation_check``, the scale-down that cannot oscillate (survivors re-predicted at
  N/(N-1) of the load: KV, ITL, TTFT against target x sensitivity).
* ``budget``: ``plan_budget``, the atomic GPU budget across pools (cut to fit, removals before additions).
* ``startup``: ``pool_to_request``, the pool size to ask for a worker start-up ahead of the forecast.
* ``correction``: ``update_correction``, the smoothed, bounded ratio of observed to predicted latency that
  ``replicas`` scales the model's times by.

Around the core, in this package but not of it (they may import more, still without I/O:
tests/unit/planner/sla/test_purity.py):

* ``config``: ``SlaPlannerConfig``, the knobs (``kvmesh planner --mode sla`` flags; pydantic, a pure config leaf).
* ``controller``: ``SlaController``, one pull of the SLA planner over a ``FleetSnapshot`` with the load planner's
  controller surface (throughput loop, fast loop, consolidation-checked scale-down, budget steps).
* ``figures``: ``SlaFigures``, a pull's SLA numbers (``PullOutcome.sla``) for TensorBoard, ``/metrics`` and status.

Reading ``--profile-results-dir`` (file I/O) is ``components.planner.sla_profile``.

Nothing is imported here, so importing one piece loads only what it needs.
"""
