"""The planner: scales a deployment's prefill and decode pools on their load (issue 14).

``policy`` (pure decisions) and ``config`` (``PlannerConfig``, ``PlannerRunConfig``: a pure config module, also a
graph's ``planner:`` section); ``loop`` (``Planner``: pulls, decides, applies, logs to TensorBoard); ``metrics``
(Prometheus ``/metrics``); ``status`` (where ``kvmesh status`` reads the planner's status); ``connectors`` (how a
pool size is set: ``local`` through a ``kvmesh serve`` deployment's circus arbiter, ``virtual`` through etcd);
``main`` (``kvmesh planner``). Nothing is imported here, so importing the pure policy loads no runtime, NATS or etcd
client (tests/unit/test_layering.py).
"""
