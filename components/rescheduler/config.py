"""The rescheduler's knobs: one pydantic model, ``ReschedulerConfig``; the flags of ``kvmesh rescheduler`` (and of a
colocated rescheduler) are derived from it by components/runtime/flags.py, so every default lives here once.

Names and defaults are Llumnix's (its rescheduler and llumlet documents, ../shared/seeds/llumnix-rescheduler.txt and
llumnix-llumlet.txt, and its scheduler's flag definitions in AlibabaPAI/llumnix ``pkg/consts``). Where the two
disagree the field's comment says which one this takes and why; docs/rescheduler.md tabulates them.

Left out: ``--standalone-rescheduling-mode`` (``kvmesh rescheduler`` is the standalone mode), the load-metric flags'
other metrics (Llumnix's rescheduler takes only ``kv_cache_usage_ratio_projected``), ``--enable-adaptive-pd`` and
``--scheduling-policy`` (dispatch, not rescheduling) and ``--llumlet-grpc-connection-pool-size`` (no gRPC here: the
migration agent answers on the request plane).

Pure config module (tests/unit/test_layering.py): the standard library and pydantic only, so a graph file's schema
(components/deploy) and the simulator may import it whatever their rank; the rescheduler's policies read it (their
own package's config, STYLE.md habit 1).
"""

from __future__ import annotations

import enum
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Policy(enum.StrEnum):
    """The rescheduling policies, by Llumnix's names (pkg/consts: ``ReschedulingPolicy*``)."""

    DECODE_LOAD = "decode_load"  # balance decode workers' projected KV use
    NEUTRAL_LOAD = "neutral_load"  # balance aggregated ("neutral") workers' projected KV use
    PREFILL_FAILOVER = "prefill_failover"  # empty failing prefill workers
    DECODE_FAILOVER = "decode_failover"  # empty failing decode workers
    NEUTRAL_FAILOVER = "neutral_failover"  # empty failing aggregated workers
    BINPACKING_MITIGATION = "binpacking_mitigation"  # move decode requests off a worker above the TPOT ceiling
    BINPACKING_CONSOLIDATION = "binpacking_consolidation"  # empty a worker below the TPOT floor into a fuller one
    # Not Llumnix's: move waiting requests (no KV yet) from an aggregated worker whose queue does not fit its free KV
    # to the one with the smallest backlog (components/rescheduler/policies/waiting.py).
    WAITING_FIT = "waiting_fit"
    # Not Llumnix's: copy hot prefixes' KV to more workers, drop cold copies (ReplicationConfig; it plans KV copies,
    # not migration pairs, so the loop runs it beside plan_cycle: components/rescheduler/replication.py).
    PREFIX_REPLICATION = "prefix_replication"


class LoadBalanceScope(enum.StrEnum):
    CLUSTER = "cluster"  # sources and destinations anywhere (one model's workers of one role)
    UNIT = "unit"  # sources and destinations within one failure unit


class FailoverDomain(enum.StrEnum):
    """What fails with a failing worker (Llumnix's ``FailoverDomain*``): no destination is chosen inside it."""

    INSTANCE = "instance"  # the worker itself
    NODE = "node"  # every worker on its node
    INSTANCE_UNIT = "instance-unit"  # every worker of its failure unit
    NODE_UNIT = "node-unit"  # every worker of every unit that has a worker on its node


# The migration agent's request selection (components/migration/types.py: ``SelectRule``/``SelectOrder``), its
# readable names and the seed's abbreviations. Spelled out here because a pure config module may not import the
# migration package; tests/unit/test_rescheduler_config.py checks both tables against it.
SELECT_RULES = {"NUM_REQ": "num_requests", "TOKEN": "tokens", "RATIO": "kv_ratio"}
SELECT_ORDERS = {
    "LCR": "last_come_running",
    "FCR": "first_come_running",
    "LR": "longest_running",
    "SR": "shortest_running",
    "FCW": "first_come_waiting",
    "FCWSR": "first_come_waiting_then_shortest_running",
}

# Llumnix's default policy list (its flag's default in both the document and the code).
DEFAULT_POLICIES = (
    Policy.DECODE_LOAD,
    Policy.PREFILL_FAILOVER,
    Policy.DECODE_FAILOVER,
    Policy.NEUTRAL_FAILOVER,
)


# --request-stats-prefixes of a frontend whose requests a rescheduler with prefix_replication reads, when the
# frontend's flags leave it unset (a colocated rescheduler's frontend; a graph's frontend beside a standalone one):
# the frontend config's maximum (its comment: at most ~300 KB a report).
REPORTED_PREFIXES = 16


def _canonical(kind: str, table: dict[str, str], text: str) -> str:
    key = text.strip()
    if key.upper() in table:
        return table[key.upper()]
    if key.lower() in table.values():
        return key.lower()
    names = ", ".join([*table.values(), *table])
    raise ValueError(f"unknown {kind} {text!r}; known: {names}")


class LlumnixConfig(BaseModel):
    """Llumnix's rescheduling knobs (the first part of ``ReschedulerConfig``, which adds ``ReplicationConfig``'s)."""

    model_config = ConfigDict(extra="forbid")

    enable_rescheduling: bool = Field(
        default=False,
        description="Run the rescheduler at all (Llumnix's switch): a frontend with --colocated-rescheduling-mode "
        "and a graph's rescheduler: section run it only when this is on.",
    )
    colocated_rescheduling_mode: bool = Field(
        default=False,
        description="Run the rescheduler inside the frontend process (Llumnix: inside the scheduler) rather than as "
        "its own process (kvmesh rescheduler).",
    )
    rescheduling_interval_ms: int = Field(
        default=500,
        gt=0,
        description="Milliseconds between two cycles; each cycle reads the fleet view, runs every policy and starts "
        "the migrations it chose. Llumnix suggests 100 for the bin-packing policies.",
    )
    rescheduling_policies: list[Policy] = Field(
        default_factory=lambda: list(DEFAULT_POLICIES),
        description="The policies a cycle runs, in this order (a pair an earlier policy chose wins over a "
        "conflicting later one): decode_load, neutral_load, prefill_failover, decode_failover, neutral_failover, "
        "binpacking_mitigation, binpacking_consolidation, waiting_fit (not Llumnix's: waiting requests from a "
        "worker whose queue does not fit its free KV to the one with the least of its queue left unadmitted), "
        "prefix_replication (not Llumnix's: the --prefix-replication-* flags).",
    )
    rescheduling_decode_load_metric: Literal["kv_cache_usage_ratio_projected"] = Field(
        default="kv_cache_usage_ratio_projected",
        description="Load metric of decode_load: projected KV use, (blocks in use + blocks the waiting requests will "
        "need) / total blocks (components/rescheduler/policies/load.py). The only one Llumnix's rescheduler takes.",
    )
    rescheduling_neutral_load_metric: Literal["kv_cache_usage_ratio_projected"] = Field(
        default="kv_cache_usage_ratio_projected",
        description="Load metric of neutral_load (as --rescheduling-decode-load-metric).",
    )
    rescheduling_decode_load_threshold: float = Field(
        default=1.0,
        gt=0,
        description="decode_load, cluster scope: decode workers whose projected KV use is at or above this are "
        "sources, those below it destinations. Projected use may pass 1 (waiting demand beyond the free blocks).",
    )
    rescheduling_neutral_load_threshold: float = Field(
        default=1.0,
        gt=0,
        description="neutral_load, cluster scope: the same threshold for aggregated workers.",
    )
    # Llumnix's document says 0.0, its code (pkg/consts DefaultReschedulingLoadBalanceThreshold) 0.01. 0.01 taken: in
    # unit scope no load threshold separates sources from destinations, and at 0 two workers 0.001 apart would make
    # a pair every 500 ms cycle, moving 1,024 tokens back and forth for a difference of one block in a thousand.
    rescheduling_load_balance_threshold: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="decode_load/neutral_load make a pair only when the source's projected KV use exceeds the "
        "destination's by more than this (a fraction of KV blocks).",
    )
    rescheduling_load_balance_scope: LoadBalanceScope = Field(
        default=LoadBalanceScope.CLUSTER,
        description="cluster: balance across all workers of a model and role, sources at or above the load "
        "threshold to destinations below it; unit: balance within each failure unit, at any load (no threshold, "
        "as in Llumnix): the unit's most loaded worker to its least loaded, and so on inwards.",
    )
    # Not Llumnix's. A fixed budget takes the same tokens from a pair 0.05 apart as from one 0.9 apart: on the trace
    # and the documents shape (requests of up to a whole worker's KV) 1,024 tokens move nothing that matters, 16,384
    # tokens overshoot small gaps (docs/rescheduler.md, "Larger budgets"). A share x of the gap, read by the
    # "closest" rule (a request is taken while its cost < 2 x the budget left), takes only requests smaller than
    # 2 x the gap: at 0.5 each leaves the pair closer than it found it (a move of s across a gap g leaves |g - 2 s|),
    # at 0.25 it also never turns the pair around (s < g / 2).
    rescheduling_load_balance_gap_budget: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="decode_load/neutral_load: 0 (Llumnix's): a pair moves the rescheduling_req_select_* budget; "
        "x > 0: a pair moves kv_ratio x times its projected-KV-use gap (at most 1) in "
        "rescheduling_req_select_order; 0.5: each request taken is smaller than the gap, 0.25: than half of it.",
    )
    instance_staleness_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A worker whose last load report is older than this many seconds is failing: the failover "
        "policies empty it and no policy sends requests to it (Llumnix's default 60).",
    )
    # Llumnix's document says instance, its code (DefaultFailoverDomain) instance-unit. instance taken: kvmesh's unit
    # is the worker's node unless the deployment labels one (components/fleet/model.py), so instance-unit would fence
    # off the failing worker's whole node, and on a one-node deployment (every `kvmesh serve` here) leave no
    # destination at all.
    failover_domain: FailoverDomain = Field(
        default=FailoverDomain.INSTANCE,
        description="What is presumed to fail with a failing worker; no policy chooses a destination inside it: "
        "instance (the worker), node (its node), instance-unit (its failure unit), node-unit (every unit with a "
        "worker on its node).",
    )
    # Llumnix's document says 50 ms (its adaptive PD example), its code (DefaultTpotSlo) 125. 50 taken: the
    # documented examples (ceiling 47.5 ms, dispatch 42.5 ms, floor 30 ms) are computed from it.
    tpot_slo: float = Field(
        default=50.0,
        gt=0,
        description="Target time per output token, in milliseconds, that the bin-packing policies compare each "
        "worker's predicted TPOT with.",
    )
    tpot_slo_dispatch_threshold: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="Fraction of --tpot-slo below which a worker's predicted TPOT makes it a bin-packing "
        "destination (0.85 x 50 = 42.5 ms).",
    )
    tpot_migrate_out_ceil_threshold: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="binpacking_mitigation: a worker whose predicted TPOT is at or above this fraction of --tpot-slo "
        "is a source (0.95 x 50 = 47.5 ms).",
    )
    # Llumnix's document says 0.60, as does one version of its code; another version says 0.50.
    tpot_migrate_out_floor_threshold: float = Field(
        default=0.60,
        gt=0,
        le=1,
        description="binpacking_consolidation: a worker running decode requests whose predicted TPOT is below this "
        "fraction of --tpot-slo is a source, emptied into the fullest destination (0.60 x 50 = 30 ms).",
    )
    rescheduling_req_select_rule: str = Field(
        default="tokens",
        description="What a load-balancing or mitigation migration's budget counts: num_requests (NUM_REQ), tokens "
        "(TOKEN) or kv_ratio (RATIO, a fraction of the source's KV capacity); Llumnix's abbreviations are accepted. "
        "Failover empties a worker (every request) and consolidation moves all its running requests, whatever this.",
    )
    rescheduling_req_select_order: str = Field(
        default="shortest_running",
        description="Which requests a migration takes first: last_come_running (LCR), first_come_running (FCR), "
        "longest_running (LR), shortest_running (SR), first_come_waiting (FCW), "
        "first_come_waiting_then_shortest_running (FCWSR). The bin-packing policies move decode requests only and "
        "take SR in place of FCW/FCWSR.",
    )
    # Llumnix's document says 1024, as does one version of its code; another says 1 (one token: with TOKEN,
    # the single shortest request).
    rescheduling_req_select_value: float = Field(
        default=1024,
        description="The budget's size: requests (-1: all), tokens, or a fraction 0..1 of the KV capacity.",
    )
    # Llumnix: --llumlet-grpc-timeout-seconds, 5 in the document (-1, no timeout, in the code). 5 taken: a call with
    # no bound would hold a cycle's source forever when its worker hangs mid-migration.
    rescheduling_migrate_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest wait for one migrate call (a source worker's agent selecting and moving requests) "
        "before it counts as failed; the cycle's other migrations go on.",
        json_schema_extra={"cli_aliases": ["--llumlet-grpc-timeout-seconds"]},
    )
    # Not Llumnix's (policies/waiting.py), hence a name of its own.
    rescheduling_waiting_fit_headroom: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="waiting_fit: the fraction of a worker's KV blocks counted as taken in its backlog (waiting "
        "blocks - free blocks + this x total), kept for its own running requests' growth.",
    )
    rescheduling_max_migrations_per_source: int = Field(
        default=1,
        ge=1,
        description="Migrations one source worker takes part in at once, over all policies and those still running "
        "from earlier cycles (Llumnix: one). A worker's agent runs max_migration_concurrency migrations at once "
        "(default 1) and queues the rest.",
    )

    @field_validator("rescheduling_policies", mode="before")
    @classmethod
    def _known_policies(cls, value: object) -> object:
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list | tuple):
            return value
        out: list[str] = []
        for raw in names:
            if isinstance(raw, Policy):
                name = raw.value
            elif isinstance(raw, str):
                name = raw.strip().lower()
            else:
                raise ValueError(f"a rescheduling policy is a name, got {raw!r}")
            if name not in {p.value for p in Policy}:
                known = ", ".join(p.value for p in Policy)
                raise ValueError(f"unknown rescheduling policy {raw!r}; known: {known}")
            if name in out:
                raise ValueError(f"rescheduling policy {name!r} is listed twice")
            out.append(name)
        return out

    @field_validator("rescheduling_req_select_rule", mode="before")
    @classmethod
    def _rule(cls, value: object) -> object:
        return _canonical("request select rule", SELECT_RULES, value) if isinstance(value, str) else value

    @field_validator("rescheduling_req_select_order", mode="before")
    @classmethod
    def _order(cls, value: object) -> object:
        return _canonical("request select order", SELECT_ORDERS, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> LlumnixConfig:
        for name in (
            "rescheduling_decode_load_threshold",
            "rescheduling_neutral_load_threshold",
            "tpot_slo",
            "rescheduling_req_select_value",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        floor, dispatch, ceil = (
            self.tpot_migrate_out_floor_threshold,
            self.tpot_slo_dispatch_threshold,
            self.tpot_migrate_out_ceil_threshold,
        )
        # A floor at or above the dispatch threshold would let consolidation pick a source that is also a
        # destination candidate of its own kind; a dispatch threshold at or above the ceiling would let mitigation
        # move requests onto a worker that is itself above the ceiling after one more step.
        if not floor < dispatch < ceil:
            raise ValueError(
                f"the TPOT thresholds must be ordered floor < dispatch < ceiling, got "
                f"tpot_migrate_out_floor_threshold {floor}, tpot_slo_dispatch_threshold {dispatch}, "
                f"tpot_migrate_out_ceil_threshold {ceil}"
            )
        value, rule = self.rescheduling_req_select_value, self.rescheduling_req_select_rule
        if rule == "num_requests" and not (value == -1 or (value >= 1 and value == int(value))):
            raise ValueError(f"rescheduling_req_select_value for num_requests is a count >= 1 or -1, got {value:g}")
        if rule == "tokens" and value < 1:
            raise ValueError(f"rescheduling_req_select_value for tokens must be >= 1, got {value:g}")
        if rule == "kv_ratio" and not 0 < value <= 1:
            raise ValueError(f"rescheduling_req_select_value for kv_ratio lies in (0, 1], got {value:g}")
        return self

    @property
    def interval_s(self) -> float:
        return self.rescheduling_interval_ms / 1000.0

    @property
    def tpot_ceiling_ms(self) -> float:
        return self.tpot_slo * self.tpot_migrate_out_ceil_threshold

    @property
    def tpot_dispatch_ms(self) -> float:
        return self.tpot_slo * self.tpot_slo_dispatch_threshold

    @property
    def tpot_floor_ms(self) -> float:
        return self.tpot_slo * self.tpot_migrate_out_floor_threshold


class ReplicationConfig(BaseModel):
    """Hot-prefix replication's knobs (components/rescheduler/policies/replication.py; docs/rescheduler.md, "Hot-prefix
    replication"). Not a Llumnix policy, so no Llumnix names: every flag starts with ``prefix_replication_``.

    ``ReschedulerConfig`` inherits these fields, so they are flags of ``kvmesh rescheduler`` (and of a colocated
    rescheduler, ``kvmesh simulate`` and a graph's ``rescheduler:`` section); they act when ``prefix_replication`` is
    among ``--rescheduling-policies``. The simulator's ``PolicyReplicator`` takes this model alone.
    """

    model_config = ConfigDict(extra="forbid")

    # 500 ms: on the documents shape (components/sim/workloads.py) a cold copy of the median document (12,000
    # tokens) costs a worker 250 ms of prefill by the perf defaults (StepTimeModel.chunked_prefill_ms), so a holder
    # predicted past 500 ms makes a hit wait longer than two cold prefills elsewhere, while a copy costs the
    # transfer (512 blocks: 22 ms at 400 Gb/s) and no request's TTFT. Not tuned on a measurement (none was run).
    prefix_replication_target_ttft_ms: float = Field(
        default=500.0,
        gt=0,
        description="A prefix is hot when its holders' mean predicted TTFT (the router's kv cost) is at or above this "
        "many ms; it then needs ceil(holders x mean / target) holders, and a copy goes only to a worker predicted "
        "below it.",
    )
    prefix_replication_min_rate_per_s: float = Field(
        default=0.5,
        ge=0,
        description="Requests per second that must carry a prefix before it is copied: a prefix used once is not "
        "hot, whatever its holder's queue.",
    )
    prefix_replication_min_blocks: int = Field(
        default=16,
        ge=1,
        description="Shortest prefix copied, in KV blocks (16 blocks = 256 tokens at block size 16): a shorter one "
        "is cheaper to recompute than to track.",
    )
    prefix_replication_max_holders: int = Field(
        default=4,
        ge=2,
        description="Most workers that hold one prefix (its holders before replication included); docs/router.md: "
        "the documents shape's hottest document needs 3-4.",
    )
    prefix_replication_max_copies_per_cycle: int = Field(
        default=2,
        ge=1,
        description="KV copies one cycle starts, over all prefixes (hottest first); at most one per prefix and one "
        "per destination, so the next cycle sees the effect of a copy before adding another.",
    )
    prefix_replication_cold_rate_per_s: float = Field(
        default=0.1,
        ge=0,
        description="A replica this policy made is cold, and dropped, when its prefix's requests per second over "
        "its holders falls below this (and the holders are below the target TTFT).",
    )
    prefix_replication_min_age_s: float = Field(
        default=30.0,
        ge=0,
        description="A replica younger than this many seconds is never dropped (a burst's lull does not undo it).",
    )
    # 30 s: PrefixRates' window in the simulator (components/sim/replication.py); the frontends report every 1 s,
    # so a prefix carried by 0.5 request/s is seen in ~15 of the window's reports.
    prefix_replication_window_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="Seconds of the frontends' request reports over which a prefix's requests per second are "
        "counted (at most 600, the fleet view's request horizon); a prefix no request carried in this window is "
        "forgotten.",
    )

    @model_validator(mode="after")
    def _check_replication(self) -> ReplicationConfig:
        for name in (
            "prefix_replication_target_ttft_ms",
            "prefix_replication_min_rate_per_s",
            "prefix_replication_min_age_s",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        # A cold rate at or above the hot rate would drop a replica the same cycle could copy again.
        if self.prefix_replication_cold_rate_per_s >= max(self.prefix_replication_min_rate_per_s, 1e-12):
            raise ValueError(
                f"prefix_replication_cold_rate_per_s ({self.prefix_replication_cold_rate_per_s}) must be below "
                f"prefix_replication_min_rate_per_s ({self.prefix_replication_min_rate_per_s})"
            )
        return self


class ReschedulerConfig(ReplicationConfig, LlumnixConfig):
    """How the rescheduler decides: which policies run, how often, their thresholds and what a pair moves, and
    hot-prefix replication's knobs."""

    # Fields come in the bases' reverse order (pydantic): Llumnix's first, then the prefix_replication_* ones; both
    # bases' validators run.
    model_config = ConfigDict(extra="forbid")
