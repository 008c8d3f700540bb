"""circus hooks that kvmesh installs on watchers through the controller (``set`` ... ``hooks``).

circus resolves a hook by its dotted name in the arbiter's process (``kvmesh serve``) and *reloads* the module each
time one is set, so this module holds nothing but the hooks: no state, no imports of kvmesh.
"""

from __future__ import annotations

from typing import Any

REFUSE_SPAWN = "components.deploy.hooks.refuse_spawn"


def refuse_spawn(**_: Any) -> bool:
    """``before_spawn``: start no new process. Set on a watcher whose process was told to leave (SIGTERM), so that
    circus does not start a fresh one when it exits; the watcher is then stopped by circus (no process, none may be
    spawned) and removed by whoever retired it."""
    return False
