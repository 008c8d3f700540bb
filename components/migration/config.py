"""``MigrationConfig``: one worker's migration knobs. ``WorkerConfig`` inherits it, so each is a ``kvmesh worker``
flag and a worker group field in a graph. Names and defaults are Llumnix's where it has the knob (its
``llumnix/config/default.py`` and ``constants.py``): ``max_migration_concurrency`` 1, ``migration_max_stages`` 3,
``migration_last_stage_max_blocks`` 16, a pending migrate-in timeout of 10 s.

Imports: pydantic and the standard library.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class MigrationConfig(BaseModel):
    """How one worker moves requests (components/migration/agent.py)."""

    max_migration_concurrency: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Migrations this worker runs at once, outgoing and incoming together (Llumnix's default); a "
        "request selected beyond it waits for a slot, a migrate_in beyond it is refused.",
    )
    migration_max_stages: int = Field(
        default=3,
        ge=1,
        description="Live migration: pre-copy stages before the final one; a request whose new blocks never fall "
        "to migration_last_stage_max_blocks within them is not moved (aborted by source), as in Llumnix.",
    )
    migration_last_stage_max_blocks: int = Field(
        default=16,
        ge=0,
        description="Live migration: go to the final stage (suspend, copy the rest, commit) once at most this many "
        "blocks remain to copy. 16 blocks of Llama-3-8B-sized KV (2 MiB each) take ~0.7 ms at 400 Gb/s.",
    )
    migration_call_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest wait for the other worker's answer to one migration message (pre_alloc, copy, commit, "
        "abort). No answer before the commit aborts the migration and the request goes on where it was; no answer "
        "to the commit itself ends the request there with a recoverable error (the destination may have taken it: "
        "the frontend re-issues it from its position rather than risk two workers answering one stream).",
    )
    migration_kv_transfer_min_tokens: int = Field(
        default=0,
        ge=0,
        description="Workers that migrate by kv_transfer (vLLM with NIXL) move a request with fewer tokens than this "
        "(prompt + outputs) by recompute instead, unless the migrate call names a mode: a KV hand-off has a fixed "
        "cost (an export on the source, a pull and its scheduling on the destination), which recomputing a short "
        "request undercuts. 0: always kv_transfer. On the 2-core CPU test machine with the tiny model the two broke "
        "even between 256 and 1,536 tokens (docs/migration.md); a GPU's break-even lies elsewhere: measure it with "
        "kvmesh bench migration --vllm.",
    )
    pending_migrate_in_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Destination: blocks reserved for an incoming migration are freed when its source has sent "
        "nothing for this long (it died, or gave up without saying so); Llumnix's PENDING_MIGRATE_IN_TIMEOUT.",
    )
    migration_source_check_s: float = Field(
        default=0.5,
        gt=0,
        description="Destination: how often the watchdog asks the request plane whether the source of a pending "
        "migration still exists; a SIGKILLed source's reservation is freed within this plus a round trip, not "
        "after the whole pending_migrate_in_timeout_s.",
    )
