"""The SLA planner's pure core (issue 25): scale the prefill and decode pools to TTFT and inter-token targets ahead
of the load. Pure functions and small classes over numbers and a ``components.perf.PerfModel``: no I/O, no clock, no
asyncio; the loop, flags, simulator and benchmark call in here.

* ``predictors``: the next interval's request count, prompt length and output length (``constant``,
  ``holt-winters``, ``kalman``; ``make_predictor``).
"""
