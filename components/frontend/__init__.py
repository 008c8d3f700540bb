"""The OpenAI-compatible frontend (aiohttp): models discovered from the workers' registrations, tokenisation and chat
templates, routing through ``components.router``, streaming back over the runtime. The only package in kvmesh that
speaks HTTP status codes (``app.py``).

``Frontend`` and ``FrontendConfig`` are loaded on first use (PEP 562), not when the package is: a graph file's
``frontend:`` section is ``FrontendConfig``, so ``kvmesh serve``, ``stop``, ``logs``, the planner and every test
that loads a graph import ``components.frontend.config``, and importing it through an eager ``__init__`` also
loaded the server, aiohttp and the runtime (0.5-0.6 s of the ~1 s a ``kvmesh logs --help`` spent importing, on the
2-core machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.frontend.config import FrontendConfig
    from components.frontend.server import Frontend

__all__ = ["Frontend", "FrontendConfig"]

_WHERE = {"Frontend": "components.frontend.server", "FrontendConfig": "components.frontend.config"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
