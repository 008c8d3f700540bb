"""``KvmeshNixlConnector``: vLLM's ``NixlConnector`` (pull mode) with the three changes it needs on a CPU host.

vLLM loads this module itself, in its engine-core process, through ``kv_transfer_config.kv_connector_module_path``
(``components.workers.engines.vllm.nixl.kv_transfer_config`` names it). Nothing in kvmesh imports it: it imports
vLLM at module level, which only a process that already runs vLLM may pay for.

What it changes, and why (measured on the 2-core CPU machines, docs/vllm-cpu.md):

1. **No NIXL progress thread.** NIXL's progress thread polls UCX with no delay: every idle engine spun one thread at
   ~98% of a core, so two idle engines took both cores. Without it, vLLM's own per-step polling (``get_finished``)
   progresses the transfers; idle engines use ~0-1% of a core. vLLM builds the agent config inside the connector
   worker's constructor from a module-level name, so that name is wrapped for the duration of the constructor only.
2. **The model thread keeps its CPU affinity.** On the CPU platform the connector worker pins the calling thread (the
   one that runs the model) to the last core of each NUMA node, i.e. every engine of the machine onto the same core;
   the affinity the thread had before is restored once the connector is built.
3. **Handshake address from the connector's extra config** (``side_channel_host``/``side_channel_port``), not only
   from ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``: one kvmesh process may start several engines at once (threads of
   one process share one ``os.environ``), and each needs its own port.

Everything else (the pull protocol, leases, heartbeats, failure handling) is vLLM's own.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _nixl_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

# Under vLLM's logger: in the engine-core and model processes only vLLM's loggers have handlers.
logger = logging.getLogger(f"vllm.{__name__}")


def _nixl_logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout (configured when vLLM imports nixl, which importing the modules above
    did); a ``kvmesh worker``'s stdout carries its READY/STOPPED lines, and vLLM's own logs already go to stderr."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


_nixl_logs_to_stderr()

__all__ = ["KvmeshNixlConnector"]


class KvmeshNixlConnector(NixlConnector):
    """vLLM's pull-mode ``NixlConnector`` with the progress thread off, the model thread's affinity kept, and the
    handshake address taken from ``kv_connector_extra_config`` (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        make_config = _nixl_worker.nixl_agent_config
        if make_config is not None:
            _nixl_worker.nixl_agent_config = functools.partial(make_config, enable_prog_thread=False)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _nixl_worker.nixl_agent_config = make_config
            if affinity is not None and os.sched_getaffinity(0) != affinity:
                os.sched_setaffinity(0, affinity)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        scheduler = self.connector_scheduler
        if scheduler is not None:
            # Read by the handshake listener (started later, with the first handshake metadata) and written into
            # every request's kv_transfer_params as remote_host/remote_port.
            if "side_channel_host" in extra:
                scheduler.side_channel_host = str(extra["side_channel_host"])
            if "side_channel_port" in extra:
                scheduler.side_channel_port = int(extra["side_channel_port"])
            logger.info(
                "kvmesh NIXL connector: engine %s, handshake on %s:%d, no progress thread",
                self.engine_id,
                scheduler.side_channel_host,
                scheduler.side_channel_port,
            )
