"""Hot-prefix replication's messages (docs/rescheduler.md, "Hot-prefix replication").

The rescheduler asks a destination worker's ``import_prefix`` endpoint to copy a prefix's KV from a source worker
that holds it: ``ImportPrefixRequest`` names the source and the prefix's chained block hashes from its start; the
destination answers one ``ImportPrefixReply``. To drop a cold replica it asks the holder's ``drop_prefix`` endpoint
(``DropPrefixRequest``, one ``DropPrefixReply``). Imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
