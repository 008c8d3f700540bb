"""Moving a prompt's KV cache between two vLLM engines with NIXL: everything kvmesh decides around vLLM's
``NixlConnector`` (pull mode), in one place that both disaggregated prefill (issue 13) and request migration (issue 15)
use.

How a hand-off goes (vLLM's own protocol; kvmesh carries the message between the two workers):

1. The **source** engine (a prefill worker's; for migration, the engine the request runs on) computes the tokens
   with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}`` (``SOURCE_PARAMS``). When the request
   ends, vLLM keeps its KV blocks and names them in the final output's ``kv_transfer_params``: engine id, request id,
   block ids per KV-cache group, handshake host and port, token count (``remote_num_tokens``).
2. Those params travel to the **target** engine's worker (``RemotePrefillResult.kv_transfer_params``), which checks
   them (``check_handoff``) and submits the **same** tokens with them (``do_remote_prefill``). vLLM's scheduler there
   allocates blocks for the tokens, its connector reads the source's blocks (UCX over TCP on loopback), and the
   engine computes the last token only, to sample the next one. The target samples the first new token itself: its
   stream is one generation, for greedy and seeded sampling alike.
3. The target's connector then notifies the source, which frees the blocks. A source whose blocks are never pulled
   (the target died, or gave up waiting) frees them when their **lease** runs out: ``kv_lease_duration`` in the
   connector's extra config (``lease_s`` here; vLLM 0.32's successor of ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). The
   target extends the lease with heartbeats every lease/6 s while the request waits in its queue.
4. A pull that fails (the source died) is recomputed by the target (``kv_load_failure_policy="recompute"``): the
   client's stream stays whole, slower.

Why the tokens submitted to the target must be exactly those the source computed: the target allocates blocks for
what it is given and pulls as many from the source. Given the prompt plus one more token, it needs one block more
than the source exported whenever the source's token count is a multiple of the block size, and vLLM 0.32's engine
dies on an assertion there (measured while migrating, ../shared/notes/vllm-kv-transfer.md). ``check_handoff`` refuses
params whose token count or block counts do not match the tokens about to be submitted; the caller then recomputes.

Imports: the standard library only (vLLM is imported by the connector module, in vLLM's own processes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "SOURCE_PARAMS",
    "UCX_ENVIRONMENT",
    "check_handoff",
    "choose_migration_mode",
    "choose_remote_prefill_mode",
    "connector_role",
    "free_loopback_port",
    "kv_transfer_config",
    "nixl_unavailable_reason",
]

CONNECTOR_CLASS = "KvmeshNixlConnector"
CONNECTOR_MODULE = "components.workers.engines.vllm.nixl_connector"

# What a source engine is asked, per request, to keep the KV for a pull.
SOURCE_PARAMS: Mapping[str, Any] = {"do_remote_decode": True}

# UCX settings of every process with a NIXL agent; values already in the environment win (an operator's override):
# - TCP (and ``self`` for an agent's own memory) on the loopback device only: no other interface is ever used, so
#   KV never leaves the machine unless an operator says otherwise. Shared memory alone fails at start-up (NIXL asks
#   UCX for peer error handling, which its shared-memory transports lack).
# - ``UCX_MODULES=^*``: load none of UCX's optional modules (tcp and self are built into libuct). Without it UCX loads
#   its InfiniBand modules even when told to use TCP, among them ``libuct_ib_mlx5_ext.so``, which the nixl-cu12
#   wheel ships under an NVIDIA proprietary licence (docs/vllm-cpu.md); with it the model process maps only
#   libucs/libucp/libuct/libucm and NIXL's UCX plugin (checked in /proc/<pid>/maps).
UCX_ENVIRONMENT: Mapping[str, str] = {
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^*",
}

# The NIXL Python packages: ``nixl`` picks a backend package at import time (cu12 on a CPU-only torch, as installed
# by scripts/install_vllm_cpu.sh).
_NIXL_BACKENDS = ("nixl_cu12", "nixl_cu13", "nixl_rocm")


def nixl_unavailable_reason() -> str | None:
    """Why this interpreter cannot run a NIXL connector (None when it can): cheap, imports nothing. A package that is
    present but broken is found out when the engine starts (``VllmEngine.start`` then falls back to recompute)."""
    try:
        if importlib.util.find_spec("nixl") is None:
            return "the nixl package is not installed (scripts/install_vllm_cpu.sh installs it)"
        if not any(importlib.util.find_spec(b) is not None for b in _NIXL_BACKENDS):
            return f"nixl is installed without a backend package ({', '.join(_NIXL_BACKENDS)})"
    except (ImportError, ValueError) as e:
        return f"nixl cannot be looked up: {e}"
    return None


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for one engine's NIXL handshake listener. It is bound again seconds later
    by vLLM's engine-core process; a port taken in between makes that engine's start fail, which
    ``VllmEngine.start`` treats like any connector failure."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kv_transfer_config(*, kv_role: str, host: str, port: int, lease_s: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.config.KVTransferConfig`` for kvmesh's NIXL connector.

    ``kv_role``: ``kv_producer`` for a prefill worker's engine, ``kv_consumer`` for a decode worker's, ``kv_both``
    for an engine that must do both (migration between aggregated workers). ``host``/``port``: this engine's
    handshake listener (one free port per engine). ``lease_s``: how long a source keeps blocks nobody pulls.
    A failed pull is recomputed, never an error for the client.
    """
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "side_channel_host": host,
            "side_channel_port": int(port),
            "kv_lease_duration": int(lease_s),
            "backends": ["UCX"],
        },
    }


_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


def check_handoff(params: Mapping[str, Any] | None, num_tokens: int, block_size: int) -> str | None:
    """Why the KV named by ``params`` (a source engine's final ``kv_transfer_params``) cannot be pulled for
    ``num_tokens`` tokens into an engine with ``block_size``-token blocks; None when it can.

    The source must have computed exactly the tokens about to be submitted (``remote_num_tokens == num_tokens``) and
    exported, in each KV-cache group, the blocks that hold them: ``ceil(num_tokens / block_size)`` (module docstring:
    one block more on the target kills vLLM 0.32's engine). A pure check of a message that crossed the network.
    """
    if not params:
        return "no KV hand-off from the source"
    if not params.get("do_remote_prefill"):
        return "the source did not keep its KV for a pull (do_remote_prefill is not set)"
    missing = [k for k in _REQUIRED if params.get(k) in (None, "")]
    if missing:
        return f"the hand-off lacks {', '.join(missing)}"
    port = params["remote_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"bad handshake port {port!r}"
    if block_size <= 0 or num_tokens <= 0:
        return f"nothing to pull ({num_tokens} tokens, block size {block_size})"
    remote_tokens = params.get("remote_num_tokens")
    if remote_tokens != num_tokens:
        return f"the source computed {remote_tokens} tokens, {num_tokens} would be submitted"
    groups = _block_groups(params["remote_block_ids"])
    if groups is None:
        return "remote_block_ids is not a list of block-id lists"
    want = -(-num_tokens // block_size)
    counts = [len(g) for g in groups]
    if not counts or any(c != want for c in counts):
        return f"the source exported {counts} blocks per KV-cache group, {num_tokens} tokens need {want}"
    return None


def _block_groups(value: Any) -> list[Sequence[Any]] | None:
    """``remote_block_ids`` as a list of groups: vLLM sends a tuple of lists (one per KV-cache group), which msgpack
    turns into a list of lists; a flat list of ints (a connector of another version) is one group."""
    if not isinstance(value, list | tuple):
        return None
    if all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return [value]
    if all(isinstance(g, list | tuple) and all(isinstance(b, int) for b in g) for g in value):
        return list(value)
    return None


_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def choose_remote_prefill_mode(role: str, configured: str, unavailable: str | None) -> tuple[str, str | None, str]:
    """(mode, kv_role, reason) for an engine of a worker of ``role`` (aggregated, prefill, decode) whose config says
    ``configured`` (auto, kv_transfer, recompute), where NIXL is unavailable for ``unavailable`` (None: available).

    ``mode`` is ``kv_transfer`` or ``recompute``; ``kv_role`` the connector's role (None: no connector); ``reason``
    says why, for the log. Raises ``ValueError`` when ``kv_transfer`` is required and NIXL is unavailable. Aggregated
    workers pull no prompt (their connector, if any, is for migration: ``choose_migration_mode``)."""
    if configured not in ("auto", "kv_transfer", "recompute"):
        raise ValueError(f"remote_prefill_mode {configured!r}: expected auto, kv_transfer or recompute")
    kv_role = _KV_ROLES.get(role)
    if kv_role is None:
        return "recompute", None, f"a {role} worker moves no KV"
    if configured == "recompute":
        return "recompute", None, "remote_prefill_mode = recompute (configured)"
    if unavailable is not None:
        if configured == "kv_transfer":
            raise ValueError(f"remote_prefill_mode = kv_transfer, but NIXL is unavailable: {unavailable}")
        return "recompute", None, f"NIXL is unavailable: {unavailable}"
    return "kv_transfer", kv_role, f"NIXL connector ({kv_role}), remote_prefill_mode = {configured}"


def choose_migration_mode(role: str, configured: str, unavailable: str | None) -> tuple[str, str]:
    """(mode, reason): how an engine of a worker of ``role`` moves its running requests to another worker, where its
    config says ``configured`` (auto, kv_transfer, recompute) and NIXL is unavailable for ``unavailable``.

    ``kv_transfer`` (an engine that is both a source and a target of hand-offs: ``connector_role``) or
    ``recompute``. A prefill worker serves no client stream, so it moves nothing (``recompute``, never used).
    Raises ``ValueError`` when ``kv_transfer`` is required and NIXL is unavailable."""
    if configured not in ("auto", "kv_transfer", "recompute"):
        raise ValueError(f"migration_mode {configured!r}: expected auto, kv_transfer or recompute")
    if role == "prefill":
        return "recompute", "a prefill worker moves no running request"
    if configured == "recompute":
        return "recompute", "migration_mode = recompute (configured)"
    if unavailable is not None:
        if configured == "kv_transfer":
            raise ValueError(f"migration_mode = kv_transfer, but NIXL is unavailable: {unavailable}")
        return "recompute", f"NIXL is unavailable: {unavailable}"
    return "kv_transfer", f"NIXL connector (kv_both), migration_mode = {configured}"


def connector_role(prefill_kv_role: str | None, migrates_kv: bool) -> str | None:
    """The connector's ``kv_role`` for an engine whose remote prefill needs ``prefill_kv_role`` (None: none) and
    that moves running requests' KV (``migrates_kv``); None: no connector.

    A migrating engine is both a source (it keeps a suspended request's KV for a pull: ``do_remote_decode``) and a
    target (it pulls: ``do_remote_prefill``), which is ``kv_both``. In vLLM 0.32's pull-mode NixlConnector the role
    decides little (measured and read in its source, docs/vllm-cpu.md): both directions key on the per-request params,
    and a producer role only adds that a request preempted while its hand-off is pending is recomputed rather than
    exporting freed blocks (``requires_kv_delivery``), which a migration source wants. vLLM logs that ``kv_both`` with
    NixlConnector is deprecated (a warning at start, nothing else)."""
    if migrates_kv:
        return "kv_both"
    return prefill_kv_role
