"""The load generator behind ``kvmesh bench load``, reusable by other benchmarks::

    from components.cli.bench.loadgen import LoadConfig, run_load
    result = await run_load(LoadConfig(url="http://127.0.0.1:8000", model="tiny-llama", concurrency=64))

Modules: ``config`` (the pydantic config, the loopback check), ``traces`` (readers, Mooncake expansion, schedule),
``client`` (one timed streaming request), ``stats`` (aggregation, percentiles, /proc CPU), ``progress``, ``runner``.
"""

from __future__ import annotations

from .config import LoadConfig
from .errors import LoadgenError, RemoteTargetError, TraceFormatError
from .runner import run_load

__all__ = ["LoadConfig", "LoadgenError", "RemoteTargetError", "TraceFormatError", "run_load"]
