"""The router's configuration: one pydantic model, ``RouterConfig``, that every routing knob lives in.

Two components embed it, so its flags (derived by components/runtime/flags.py) mean the same everywhere:

- ``FrontendConfig`` extends it: ``kvmesh frontend --router-policy kv --router-temperature 0.1`` routes inside the
  frontend, as Dynamo's frontend does with the same flags;
- ``RouterServiceConfig`` extends it with where the standalone ``kvmesh router`` registers and what it watches.

Names follow Dynamo's router where it has the knob (``--router-temperature``, ``--kv-overlap-score-weight``,
``--router-kv-events``, ``--router-ttl-secs``, ``--router-replica-sync``, ``--active-decode-blocks-threshold``,
``--active-prefill-tokens-threshold``), with Dynamo's defaults; the imbalance override borrows sglang's
``balance_abs_threshold``/``balance_rel_threshold`` test; the Autellix knobs follow the Autellix paper
(``locality_threshold_tokens`` = its 2048-token threshold). Where a Dynamo flag has a unit-less spelling (``-secs``)
the field carries kvmesh's unit suffix and the Dynamo spelling stays as a flag alias (``cli_aliases``).

Policies (``policies/*.py``) read this model directly: it is their package's config (STYLE.md habit 1 allows it), so
every default lives here and nowhere else.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from components.router.names import ALIASES, POLICY_NAMES


class LoadMetric(enum.StrEnum):
    """What "least used" counts (Autellix's LEAST_USED leaves it open)."""

    REQUESTS = "requests"  # requests this router (and its replicas) sent to the worker and have not seen finish
    TOKENS = "tokens"  # their prompt tokens: a worker with one 30k-token prompt is busier than one with two chats


class RouterConfig(BaseModel):
    """How requests are placed on workers: the policy and its knobs."""

    model_config = ConfigDict(extra="forbid")

    router_policy: str = Field(
        default="round_robin",
        description="Routing policy by its registered name: round_robin, random, power_of_two, least_loaded, "
        "autellix, kv, kv+autellix, kv_dynamo (aliases: round-robin, least_used, power-of-two, kv_autellix).",
    )
    router_seed: int | None = Field(
        default=None,
        description="Seed of the router's random.Random (ties, sampling, power-of-two picks); unset: fresh entropy "
        "per process. Set it to replay a run decision for decision.",
    )
    # --- kv ------------------------------------------------------------------------------------------------------
    overlap_weight: float = Field(
        default=1.0,
        ge=0.0,
        description="kv_dynamo: weight of prefill blocks against decode blocks in cost = overlap_weight * "
        "prefill_blocks_to_compute + active_decode_blocks. Higher favours cache reuse (TTFT), lower favours balance "
        "(ITL); 0 routes by load alone.",
        json_schema_extra={"cli_aliases": ["--kv-overlap-score-weight", "--router-kv-overlap-score-weight"]},
    )
    decode_weight: float = Field(
        default=1.0,
        ge=0.0,
        description="kv: weight of the decode step a request would share (its inter-token latency, ms) against its "
        "predicted time to first token (ms) in cost = ttft + decode_weight * decode_step. 0 routes for TTFT alone.",
    )
    successor_weight: float = Field(
        default=1.0,
        ge=0.0,
        description="kv: how many later requests on a worker the uncached prefill of this one delays, counted in its "
        "cost beside its own time to first token (ms): cost = queued + (1 + successor_weight) * uncached prefill + "
        "decode_weight * decode step. 0 routes for this request's TTFT alone; 1 keeps cached prefixes in use at "
        "high load (docs/router.md).",
    )
    router_temperature: float = Field(
        default=0.0,
        ge=0.0,
        description="kv: 0 picks the lowest cost (ties broken at random); above 0 samples from softmax(-c / T) over "
        "costs normalised to [0, 1], so 1.0 gives the worst worker e^-1 = 0.37 times the best one's odds.",
    )
    router_kv_events: bool = Field(
        default=True,
        description="kv: follow the workers' KV events (exact prefix overlap). --no-router-kv-events predicts "
        "cache contents from this router's own assignments for router_ttl_s instead, for engines without events.",
    )
    router_ttl_s: float = Field(
        default=120.0,
        gt=0.0,
        description="kv without KV events: how long a routed request's blocks are assumed cached on its worker.",
        json_schema_extra={"cli_aliases": ["--router-ttl-secs"]},
    )
    router_provisional_ttl_s: float = Field(
        default=5.0,
        ge=0.0,
        description="kv with KV events: the blocks a routed request's worker will compute count as held there (and "
        "at every replica, through replica sync) from the decision until the worker's KV events confirm them, or "
        "for at most this long; 0: off (a prefix sent again before the worker's events arrive is not seen there). "
        "The events come after the prefill's queueing and compute, the worker's 10 ms batch and NATS: on the busy "
        "2-core dev VM (load 18-25, 8 frontend processes, simulated workers) p50 70-380 ms, p99 1.1-3.0 s, max "
        "3.0 s (docs/frontend.md); an unconfirmed prediction (a request that failed before its prefill) misleads "
        "for at most this long.",
    )
    prompt_hash_cache_blocks: int = Field(
        default=262_144,
        ge=0,
        description="kv: block hashes of recently seen prompt chunks the router keeps (least recently used out), so a "
        "prefix it has hashed before (a conversation's history, a shared document) is not chained again: ~14 bytes "
        "a block, ~3.6 MB at the default (4M tokens of distinct prefixes at 16 tokens a block); 0: hash every prompt "
        "in full.",
    )
    active_decode_blocks_threshold: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="kv: a worker whose reported KV usage (active / total blocks) exceeds this fraction is busy and "
        "gets no new requests while another is not busy; unset: off.",
    )
    active_prefill_tokens_threshold: int | None = Field(
        default=None,
        ge=0,
        description="kv: a worker reporting more prompt tokens than this waiting to be prefilled is busy; unset: off.",
    )
    balance_abs_threshold: int = Field(
        default=32,
        ge=0,
        description="kv: imbalance override, absolute part: route by load alone when the most and least loaded "
        "candidates differ by more than this many requests in flight AND by more than balance_rel_threshold.",
    )
    balance_rel_threshold: float = Field(
        default=1.5,
        ge=1.0,
        description="kv: imbalance override, relative part: most loaded > balance_rel_threshold * least loaded.",
    )
    # --- least_loaded / autellix ---------------------------------------------------------------------------------
    least_loaded_metric: LoadMetric = Field(
        default=LoadMetric.REQUESTS,
        description="least_loaded and Autellix's LEAST_USED: count requests in flight, or their prompt tokens.",
    )
    locality_threshold_tokens: int = Field(
        default=2048,
        ge=0,
        description="autellix: a request with at most this many prompt tokens goes to the least-used worker; a "
        "longer one to its program's worker (Autellix's data-locality threshold).",
    )
    program_ttl_s: float = Field(
        default=600.0,
        gt=0.0,
        description="autellix: a program's worker assignment is forgotten after this long without a long request.",
    )
    # --- worker liveness from load metrics -----------------------------------------------------------------------
    metrics_stale_intervals: float = Field(
        default=5.0,
        gt=0.0,
        description="A worker whose load metrics are older than this many of its own publishing intervals (as "
        "observed) is presumed dead: it gets no requests while a worker with fresh metrics remains. At the "
        "worker's default 100 ms interval that is 0.5 s, long before its lease (10 s) expires.",
    )
    metrics_stale_min_s: float = Field(
        default=0.5,
        gt=0.0,
        description="Lower bound of that staleness horizon, so one late message on a fast publisher is not a death.",
    )
    # --- replicas ------------------------------------------------------------------------------------------------
    router_replica_sync: bool = Field(
        default=False,
        description="Share in-flight assignments with the namespace's other routers (frontends and kvmesh router "
        "replicas) over NATS, so each one counts every replica's requests as load.",
    )
    router_sync_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        description="With replica sync: how often each router publishes its whole in-flight table (heals lost "
        "messages and teaches late joiners); a replica silent for 5 intervals is forgotten.",
    )

    @field_validator("router_policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICY_NAMES and v not in ALIASES:
            known = sorted(POLICY_NAMES) + sorted(ALIASES)
            raise ValueError(f"unknown routing policy {v!r}; known: {', '.join(known)}")
        return v


class RouterServiceConfig(RouterConfig):
    """The standalone router (``kvmesh router``): where it registers, which workers it routes to, and its policy."""

    namespace: str = Field(default="kvmesh", description="Namespace whose workers this router places requests on.")
    component: str = Field(
        default="router",
        description="Component the router registers its 'route' and 'report' endpoints under; replicas share it.",
    )
    components: list[str] = Field(
        default_factory=lambda: ["backend"],
        min_length=1,
        description="Components whose 'generate' instances it routes to; their metadata names the model.",
    )
    router_replica_sync: bool = Field(
        default=True,
        description="Share in-flight assignments with the other replicas (and frontends with sync on) over NATS. "
        "On by default here: running several replicas is what a standalone router is for.",
    )
