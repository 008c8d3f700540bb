"""The rescheduler (issue 26): Llumnix's global migration policies over the fleet view.

- ``config``: ``ReschedulerConfig``, every knob with Llumnix's name and default (a pure config module);
- ``types``: ``InstanceView`` (what policies read), ``MigrationPair``, ``Rejection``, ``CyclePlan``;
- ``policies``: the pure policies and ``plan_cycle``;
- ``views``: ``instance_views(FleetSnapshot)``, the fleet view as ``InstanceView``s with predicted TPOT (imports
  components.fleet; imported explicitly).

Rank 5 (tests/unit/test_layering.py): imports fleet, migration and perf; sim imports it; the frontend does not (the
command line wires a colocated rescheduler). Importing this package loads nothing.
"""
