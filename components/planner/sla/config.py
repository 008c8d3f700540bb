"""The SLA planner's knobs, ``SlaPlannerConfig``: defined in ``components/planner/config.py`` (the planner's pure
config module, which a graph file's ``planner:`` section may import from below the planner package; where the names
and defaults come from is written there) and named here for the SLA package's own modules and tests."""

from __future__ import annotations

from components.planner.config import LoadPredictorName, SlaPlannerConfig

__all__ = ["LoadPredictorName", "SlaPlannerConfig"]
