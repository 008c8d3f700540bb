"""Reading the SLA planner's ``--profile-results-dir``: a ``kvmesh profile`` JSON file, or a directory holding one, as
the ``components.perf.Profile`` the controller sizes pools with (``SlaController(config, model, perf=...)``). The
file I/O the pure controller does not do (components/planner/sla/controller.py); the live planner and the simulator's
callers call this once, at start.

A directory is searched for ``*.json`` files that parse as profiles (other JSON, such as a results file, is passed
over); exactly one must: none is an error naming the directory, and two are ambiguous (which engine's?), an error
naming both. Dynamo's flag takes a directory of its profiler's results; ours takes either, since ``kvmesh profile``
writes one file (``--out``).
"""

from __future__ import annotations

from pathlib import Path

from components.perf.errors import ProfileFormatError
from components.perf.profile import Profile

__all__ = ["ProfileResultsError", "load_profile_results"]


class ProfileResultsError(ValueError):
    """``--profile-results-dir`` names no usable profile: the message says what was found there."""


def load_profile_results(path: str | Path) -> Profile:
    """The profile at ``path`` (a file, or a directory holding exactly one profile JSON; module docstring)."""
    p = Path(path)
    if p.is_file():
        return Profile.load(p)
    if not p.is_dir():
        raise ProfileResultsError(f"profile results {str(p)!r}: no such file or directory")
    found: list[tuple[Path, Profile]] = []
    for candidate in sorted(p.glob("*.json")):
        try:
            found.append((candidate, Profile.load(candidate)))
        except ProfileFormatError:
            continue  # another JSON file (a benchmark's results, a config): not a profile
    if not found:
        raise ProfileResultsError(f"profile results directory {str(p)!r} holds no `kvmesh profile` JSON file")
    if len(found) > 1:
        names = ", ".join(c.name for c, _ in found)
        raise ProfileResultsError(f"profile results directory {str(p)!r} holds several profiles ({names}): name one")
    return found[0][1]
