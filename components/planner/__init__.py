"""The planner: scales a deployment's prefill and decode pools on their load (issue 14).

``policy`` (pure decisions) and ``config`` (``PlannerConfig``); ``loop`` (``Planner``: pulls, decides, applies, logs
to TensorBoard); ``connectors`` (how a pool size is set); ``main`` (``kvmesh planner``). Nothing is imported here, so
importing the pure policy loads no runtime, NATS or etcd client (tests/unit/test_layering.py).
"""
