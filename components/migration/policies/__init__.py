"""Pure migration policies: functions over snapshots, no I/O (STYLE.md habit 1; tests/unit/test_layering.py)."""
