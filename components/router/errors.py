"""Typed errors of the router (one small hierarchy, STYLE.md habit 7)."""

from __future__ import annotations


class RouterError(Exception):
    """Root of every error raised by ``components.router``."""


class UnknownPolicyError(RouterError, ValueError):
    """A policy name that is not registered; ``known`` lists the names that are."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown routing policy {name!r}; known: {', '.join(sorted(known))}")
        self.name = name
        self.known = known


class NoWorkersError(RouterError):
    """The policy placed the request nowhere (no workers, or every worker was already tried). Recoverable: workers
    may register in a moment."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(reason)
        self.model = model
        self.reason = reason


class RouterProtocolError(RouterError, ValueError):
    """A message on the router's endpoints or sync topic that does not parse (a bug or a foreign publisher)."""
