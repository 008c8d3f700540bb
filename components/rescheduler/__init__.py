"""The rescheduler (issue 26): Llumnix's global migration policies over the fleet view.

- ``config``: ``ReschedulerConfig``, every knob with Llumnix's name and default (a pure config module);
- ``types``: ``InstanceView`` (what policies read), ``MigrationPair``, ``Rejection``, ``CyclePlan``;
- ``policies``: the pure policies and ``plan_cycle``;
- ``views``: ``instance_views(FleetSnapshot)``, the fleet view as ``InstanceView``s with predicted TPOT (imports
  components.fleet; imported explicitly);
- hot-prefix replication: ``policies.replication`` (the pure policy), ``replication_inputs`` (its snapshot from the
  fleet view), ``replication`` (the workers' ``import_prefix``/``drop_prefix`` calls), ``replicator``
  (``LiveReplicator``, what the loop runs with ``prefix_replication``: imports the router for its KV index).

Rank 5 (tests/unit/test_layering.py): imports fleet, router, migration and perf; sim imports it; the frontend does
not (the command line wires a colocated rescheduler). Importing this package loads nothing.
"""
