"""msgpack encoding of everything that crosses the bus. Dataclasses with ``to_dict`` are packed through it."""

from __future__ import annotations

from typing import Any

import msgpack

_packer = msgpack.Packer(use_bin_type=True, default=lambda o: o.to_dict())


def pack(obj: Any) -> bytes:
    """Encode; objects msgpack does not know are packed through their ``to_dict()``."""
    return _packer.pack(obj)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
