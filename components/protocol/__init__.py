"""kvmesh's wire contract: what every process exchanges, and nothing else.

- ``messages``: generation requests, token chunks, load snapshots, KV events;
- ``endpoints``: endpoint and topic names;
- ``metadata``: the worker's registration metadata (``WorkerMetadata``, ``WorkerRole``) and the rules that read it;
- ``errors``: errors as they cross the wire (``ErrorPayload``, ``ErrorCode``).

Room for the migration and prefill-queue messages of the issues that come next. This package imports nothing of
kvmesh (tests/unit/test_layering.py), so any component, the runtime included, can depend on it.
"""
