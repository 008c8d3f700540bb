"""Request migration: moving a running request from one worker to another without its client noticing.

What lives here, lowest first (each module's docstring says more):

- ``types.py``: the selection vocabulary (``SelectRule``, ``SelectOrder``: readable names, the seed's abbreviations
  ``NUM_REQ``/``TOKEN``/``RATIO`` and ``LCR``/``FCR``/``LR``/``SR``/``FCW``/``FCWSR`` accepted) and the engine's
  request table as selection sees it (``RequestView``, ``RequestTable``);
- ``config.py``: ``MigrationConfig``, the per-worker knobs (concurrency cap, stages, timeouts), inherited by
  ``WorkerConfig`` so that they are ``kvmesh worker`` flags;
- ``policies/selection.py``: which requests to move, a pure function over the request table;
- ``states.py``: the explicit state machine of one migration and the per-worker table that caps and counts them;
- ``engine.py``: what the agent needs of an engine (the source's suspend/resume/release, the destination's
  reserve/copy/commit), implemented by the simulated engine (live) and the vLLM adapter (recompute);
- ``agent.py``: the per-worker agent (Llumnix's llumlet): the ``migrate``, ``migrate_in`` and ``abort`` endpoints,
  the source and destination halves of a migration, the destination's watchdog, abort forwarding.

Rank 2 in the layering (tests/unit/test_layering.py): it imports ``protocol`` and ``runtime`` only; ``workers``
import it. Importing this package (or its policies) loads no I/O client: ``agent.py`` is imported explicitly.
"""
