"""Hot-prefix replication's messages (docs/rescheduler.md, "Hot-prefix replication").

The rescheduler asks a destination worker's ``import_prefix`` endpoint to copy a prefix's KV from a source worker
that holds it: ``ImportPrefixRequest`` names the source and the prefix's chained block hashes from its start; the
destination answers one ``ImportPrefixReply``. To drop a cold replica it asks the holder's ``drop_prefix`` endpoint
(``DropPrefixRequest``, one ``DropPrefixReply``).

A destination whose engine pulls KV over a connector (vLLM with NIXL) first asks the source's ``export_prefix``
endpoint (``ExportPrefixRequest``, one ``ExportPrefixReply``): the source names the prefix's blocks by vLLM's
hand-off and says which tokens they hold, since the engine pulls blocks for a prompt, not for hashes. Imports nothing
but the standard library.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class PrefixCopyMode(enum.StrEnum):
    """How a worker takes part in a prefix copy, either end (``WorkerMetadata.prefix_copy_mode``; "" there: it
    cannot, so the rescheduler makes it neither a copy's source nor its destination)."""

    SIMULATED = "simulated"  # a simulated engine: the source's kv_state, the modelled transfer, the import
    KV_TRANSFER = "kv_transfer"  # vLLM with its NIXL connector and prefix caching: a hand-off the destination pulls


@dataclasses.dataclass(frozen=True, slots=True)
class ImportPrefixRequest:
    source_id: int
    block_hashes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"source_id": self.source_id, "block_hashes": list(self.block_hashes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImportPrefixRequest:
        return cls(int(d["source_id"]), tuple(int(h) for h in d["block_hashes"]))


@dataclasses.dataclass(frozen=True, slots=True)
class ImportPrefixReply:
    """``held_by_source``: the blocks of the prefix, from its start, the source held when asked (only those are
    copied); ``imported``: the blocks the destination cached (fewer when it already held some); ``transfer_s``: the
    modelled transfer the destination waited; ``error``: why nothing was copied ("" when it was)."""

    held_by_source: int = 0
    imported: int = 0
    transfer_s: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImportPrefixReply:
        return cls(
            int(d.get("held_by_source", 0)),
            int(d.get("imported", 0)),
            float(d.get("transfer_s", 0.0)),
            str(d.get("error", "")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class DropPrefixRequest:
    """Evict the cached blocks of the prefix named by its chained ``block_hashes`` (from its start)."""

    block_hashes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"block_hashes": list(self.block_hashes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DropPrefixRequest:
        return cls(tuple(int(h) for h in d["block_hashes"]))


@dataclasses.dataclass(frozen=True, slots=True)
class DropPrefixReply:
    """``dropped``: blocks of the prefix the worker evicted (announced with ``BLOCK_REMOVED``); ``in_use``: blocks
    of it kept because a request uses them; ``error``: why nothing was done ("" otherwise)."""

    dropped: int = 0
    in_use: int = 0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DropPrefixReply:
        return cls(int(d.get("dropped", 0)), int(d.get("in_use", 0)), str(d.get("error", "")))


@dataclasses.dataclass(frozen=True, slots=True)
class ExportPrefixRequest:
    """Keep the cached blocks of the prefix named by its chained ``block_hashes`` (from its start) for a pull."""

    block_hashes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"block_hashes": list(self.block_hashes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExportPrefixRequest:
        return cls(tuple(int(h) for h in d["block_hashes"]))


@dataclasses.dataclass(frozen=True, slots=True)
class ExportPrefixReply:
    """``held``: the blocks of the prefix, from its start, the source held and kept for a pull; ``token_ids``: the
    tokens they hold (``held`` whole blocks); ``kv_transfer_params``: the engine's hand-off naming the kept blocks
    (vLLM's, opaque here); ``error``: why nothing was kept ("" when it was)."""

    held: int = 0
    token_ids: tuple[int, ...] = ()
    kv_transfer_params: dict[str, Any] | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "held": self.held,
            "token_ids": list(self.token_ids),
            "kv_transfer_params": self.kv_transfer_params,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExportPrefixReply:
        params = d.get("kv_transfer_params")
        return cls(
            int(d.get("held", 0)),
            tuple(int(t) for t in d.get("token_ids") or ()),
            None if params is None else dict(params),
            str(d.get("error", "")),
        )
