"""Errors as they cross the wire: a typed payload, not a class name.

A handler that raises sends ``ErrorPayload.of(exc)`` in its stream's ERROR frame; the client side
(``components.runtime``) raises ``RemoteHandlerError`` carrying the payload's fields, and callers decide on ``code``
and ``recoverable``, never on the Python class name (renaming an exception must not change an HTTP status).

An exception says how it travels with two class attributes, read here by duck typing so that this module imports
nothing of kvmesh and an exception class needs nothing but the attributes:

- ``wire_code``: an ``ErrorCode`` (default ``INTERNAL``);
- ``wire_param``: which request field was wrong, for ``REQUEST_INVALID`` (OpenAI's ``param``), or None.

``recoverable`` is derived from the code: the same request may succeed on another instance.

Imports: the standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class ErrorCode(enum.StrEnum):
    """What went wrong, as every process agrees to name it."""

    REQUEST_INVALID = "request_invalid"  # the request itself is bad (prompt too long, token id out of range): 400
    ENGINE_DEAD = "engine_dead"  # the instance's engine is gone; another instance may serve the same request
    OVERLOADED = "overloaded"  # the instance cannot take it now (no free blocks); another may
    INTERNAL = "internal"  # anything else: a bug or an unexpected failure on the instance
    ABORTED = "aborted"  # someone ended the request on purpose (the ``abort`` endpoint): not to be re-issued


# Codes after which the same request may go to another instance.
RECOVERABLE_CODES = frozenset({ErrorCode.ENGINE_DEAD, ErrorCode.OVERLOADED})


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorPayload:
    """One error on the wire: ``code`` decides, ``type`` and ``message`` explain (logs, the client's message)."""

    code: ErrorCode
    message: str
    type: str = ""  # the raising class's name, for people reading logs only
    param: str | None = None

    @property
    def recoverable(self) -> bool:
        return self.code in RECOVERABLE_CODES

    @classmethod
    def of(cls, exc: BaseException) -> ErrorPayload:
        code = getattr(exc, "wire_code", ErrorCode.INTERNAL)
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INTERNAL
        param = getattr(exc, "wire_param", None)
        return cls(code, str(exc), type(exc).__name__, param if isinstance(param, str) else None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": str(self.code),
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "recoverable": self.recoverable,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ErrorPayload:
        """Tolerant: an older peer sent only ``type`` and ``message``; an unknown code is ``INTERNAL``."""
        if not isinstance(d, dict):
            return cls(ErrorCode.INTERNAL, repr(d))
        try:
            code = ErrorCode(d.get("code", ErrorCode.INTERNAL))
        except ValueError:
            code = ErrorCode.INTERNAL
        param = d.get("param")
        return cls(code, str(d.get("message", "")), str(d.get("type", "")), param if isinstance(param, str) else None)
