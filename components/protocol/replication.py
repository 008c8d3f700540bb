"""Hot-prefix replication's messages (docs/rescheduler.md, "Hot-prefix replication").

The rescheduler asks a destination worker's ``import_prefix`` endpoint to copy a prefix's KV from a source worker
that holds it: ``ImportPrefixRequest`` names the source and the prefix's chained block hashes from its start; the
destination answers one ``ImportPrefixReply``. Imports nothing but the standard library.
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
