"""The migration package's errors: one small hierarchy (STYLE.md habit 7). Pure: the standard library only."""

from __future__ import annotations


class MigrationError(Exception):
    """Root of migration errors."""


class UnknownSelectionError(MigrationError, ValueError):
    """A select rule or order that is neither a readable name nor one of the seed's abbreviations."""

    def __init__(self, what: str, given: str, names: list[str], aliases: list[str]) -> None:
        super().__init__(f"unknown {what} {given!r}: use one of {', '.join(names)} (or {', '.join(aliases)})")
        self.what = what
        self.given = given


class InvalidSelectionError(MigrationError, ValueError):
    """A selection value the rule cannot use (a negative token budget, a ratio above 1)."""


class IllegalTransitionError(MigrationError):
    """A migration asked to go to a state its current state cannot lead to (a bug in the caller)."""

    def __init__(self, migration_id: str, current: str, wanted: str) -> None:
        super().__init__(f"migration {migration_id}: cannot go from {current} to {wanted}")
        self.migration_id = migration_id
        self.current = current
        self.wanted = wanted
