"""The rescheduler (issue 26): pure policies over the fleet view, and the loop that runs them and moves requests
through the workers' ``migrate`` endpoints. Rank 5 (tests/unit/test_layering.py). Importing this package loads no
I/O client: the loop (``loop``), the executor (``executor``) and the metrics (``metrics``) are imported explicitly."""
