"""The pure half of the vLLM adapter: kvmesh <-> vLLM translations that need neither vLLM nor a running engine.

* ``sampling_kwargs``: kvmesh ``SamplingParams`` -> keyword arguments of ``vllm.SamplingParams``;
* ``validate_prompt``: token ids must lie in ``[0, vocab_size)``. With ``skip_tokenizer_init`` vLLM checks nothing,
  and one id out of range kills the engine for every request (``IndexError`` in the model, then ``EngineDeadError``:
  measured in docs/vllm-cpu.md), so this check is the only thing between a bad client and a dead worker;
* ``finish_reason``: vLLM's finish reason strings -> ``FinishReason``;
* ``decode_kv_event_batch``: one message of vLLM's ZMQ KV-event publisher -> plain dicts, read with ``msgpack`` rather
  than vLLM's msgspec types, so that this module (and its tests) do not need vLLM and extra fields in a later vLLM
  version are ignored rather than fatal;
* ``KvEventTranslator``: vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` -> kvmesh ``KvEvent`` with
  kvmesh's block hashes and event ids, plus the mirror of cached blocks that ``kv_state()`` answers from;
* ``VllmStats``: the numbers a ``LoadSnapshot`` needs, updated from vLLM's ``SchedulerStats``/``IterationStats``.

Why translate hashes at all: vLLM's block hash is its own (sha256-based, seeded, 64-bit-truncated), the router's is
``components.protocol.kv_hashing``'s. vLLM's ``BlockStored`` carries the stored blocks' token ids and the parent
block's (vLLM) hash, so the kvmesh hashes follow from ``block_hashes(token_ids, block_size, parent_hash=kvmesh hash
of that parent)``: each block's hash covers the whole prefix up to it, so the chain equals ``block_hashes`` of the
full prompt. A vLLM -> kvmesh map lets ``BlockRemoved`` (which carries only vLLM hashes) translate.

Tokens: the translator also keeps each cached block's token ids (a 4-byte ``array`` per block: 128 bytes at block
size 32), so that ``prefix_tokens`` can answer which tokens a prefix named only by kvmesh hashes holds: vLLM pulls
KV for a prompt (its tokens), never for hashes, and the rescheduler that asks for a copy knows only the hashes
(hot-prefix replication, components/workers/replication.py).

Reference counts: vLLM can hold one hash in two physical blocks (two requests that computed the same block before
either was cached each store it and each evict it). The translator counts copies and announces a removal only when
the last copy goes, so a router's set of (worker, hash) pairs stays exact; a repeated store is announced again, which
a set ignores.

Imports: the standard library, ``msgpack``, the engine contract and ``components.protocol.kv_hashing``.
"""

from __future__ import annotations

import array
import dataclasses
import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import msgpack

from components.protocol.errors import ErrorCode
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import (
    FinishReason,
    KvEvent,
    KvEventKind,
    KvStateSnapshot,
    LoadSnapshot,
    SamplingParams,
)

from ..base import EngineRequestError

__all__ = [
    "DuplicateRequestError",
    "KvEventTranslator",
    "TokenIdOutOfRangeError",
    "VllmStats",
    "decode_kv_event_batch",
    "finish_reason",
    "sampling_kwargs",
    "validate_prompt",
]

logger = logging.getLogger(__name__)

# vLLM's device tier. Events of other tiers (CPU/disk offloading, not enabled by kvmesh) describe caches the router
# does not model, so they are skipped rather than mixed into the device's view.
DEVICE_MEDIA = (None, "GPU")


# --- requests -----------------------------------------------------------------------------------------------------


class TokenIdOutOfRangeError(EngineRequestError):
    """A prompt token id outside the model's vocabulary (it would crash vLLM's engine, see the module docstring)."""

    wire_param = "prompt"

    def __init__(self, token_id: int, position: int, vocab_size: int) -> None:
        super().__init__(
            f"prompt token id {token_id} at position {position} is outside the model's vocabulary [0, {vocab_size})"
        )
        self.token_id = token_id
        self.position = position
        self.vocab_size = vocab_size


class DuplicateRequestError(EngineRequestError):
    """A request with this id is already in flight on this engine (``abort(id)`` could not tell them apart)."""

    wire_code = ErrorCode.INTERNAL  # a frontend reused an id: not the client's to fix

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} is already in flight in this engine")
        self.request_id = request_id


def validate_prompt(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``EngineRequestError`` for an empty prompt or ``TokenIdOutOfRangeError`` for an id outside the vocabulary.

    ``min``/``max`` run in C: ~60 us for 8192 ids, next to a prefill of milliseconds. The position is searched only
    on the error path.
    """
    if not token_ids:
        raise EngineRequestError("the prompt has no tokens")
    lo, hi = min(token_ids), max(token_ids)
    if lo >= 0 and hi < vocab_size:
        return
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise TokenIdOutOfRangeError(t, i, vocab_size)


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams``; the caller adds ``output_kind`` and ``detokenize``.

    kvmesh's ``top_k = -1`` ("off", the OpenAI-style default) becomes vLLM's ``0`` (its "off"; vLLM also accepts
    -1, but 0 is what it stores). Out-of-range values are left for vLLM to reject (its ``ValueError`` becomes an
    ``EngineRequestError``), so the rules live in one place.
    """
    return {
        "n": 1,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }


_FINISH_REASONS = {
    "stop": FinishReason.STOP,  # EOS (from generation_config.json) or a stop token
    "length": FinishReason.LENGTH,  # max_tokens or max_model_len
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,  # vLLM's repetition detector ended it: a stop, not a truncation
}


def finish_reason(vllm_reason: str | None) -> FinishReason | None:
    """Map vLLM's finish reason; raises ``EngineRequestError`` for ``"error"`` (the engine failed this request)."""
    if vllm_reason is None:
        return None
    try:
        return _FINISH_REASONS[vllm_reason]
    except KeyError:
        raise EngineRequestError(f"vLLM ended the request with finish reason {vllm_reason!r}") from None


# --- KV events ----------------------------------------------------------------------------------------------------


def decode_kv_event_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """One ``KVEventBatch`` as vLLM's publisher sends it (msgpack array ``[ts, events, data_parallel_rank]``, each
    event a map tagged ``"type"``) -> ``(ts, events)``."""
    batch = msgpack.unpackb(payload, strict_map_key=False)
    return float(batch[0]), list(batch[1])


@dataclasses.dataclass(slots=True)
class _Mirrored:
    kvmesh_hash: int
    copies: int


class KvEventTranslator:
    """vLLM KV events -> kvmesh ``KvEvent`` batches, and the mirror of cached blocks behind ``kv_state()``.

    Event ids start at 1 and increase by one per emitted event (0 means "none yet", as in the mock engine).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.last_event_id = 0
        self._by_vllm_hash: dict[Hashable, _Mirrored] = {}
        self._copies: dict[int, int] = {}  # kvmesh hash -> physical copies held; insertion order = store order
        self._tokens: dict[int, array.array[int]] = {}  # kvmesh hash -> the block's token ids, while cached
        # Skipped input, for diagnostics and tests.
        self.num_unknown_parents = 0  # BlockStored whose parent was never seen (events lost before a replay)
        self.num_unknown_removals = 0  # BlockRemoved of a hash never seen
        self.num_skipped = 0  # other tiers, other KV-cache groups, malformed events

    def translate(self, events: Iterable[Mapping[str, Any]]) -> list[KvEvent]:
        out: list[KvEvent] = []
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev, out)
            elif kind == "BlockRemoved":
                self._removed(ev, out)
            elif kind == "AllBlocksCleared":
                self._by_vllm_hash.clear()
                self._copies.clear()
                self._tokens.clear()
                out.append(self._event(KvEventKind.ALL_CLEARED))
            else:
                self.num_skipped += 1
                logger.debug("skipping KV event of unknown type %r", kind)
        return out

    def kv_state(self) -> KvStateSnapshot:
        return KvStateSnapshot(
            last_event_id=self.last_event_id, block_size=self.block_size, block_hashes=list(self._copies)
        )

    def kvmesh_hash(self, vllm_hash: Hashable) -> int | None:
        m = self._by_vllm_hash.get(vllm_hash)
        return None if m is None else m.kvmesh_hash

    @property
    def num_cached_blocks(self) -> int:
        return len(self._copies)

    def holds(self, kvmesh_hash: int) -> bool:
        """Whether a block with this kvmesh hash is cached now (as the events said)."""
        return kvmesh_hash in self._copies

    def vllm_hashes(self, kvmesh_hashes: Iterable[int]) -> list[Hashable]:
        """vLLM's hashes (as its events name them) of the cached blocks with these kvmesh hashes: one kvmesh hash may
        have more than one (module docstring). A scan of the mirror, for a rare call (a prefix's drop)."""
        want = set(kvmesh_hashes)
        return [vh for vh, m in self._by_vllm_hash.items() if m.kvmesh_hash in want]

    def prefix_tokens(self, kvmesh_hashes: Iterable[int]) -> list[int]:
        """The token ids of the run of ``kvmesh_hashes``, from the first, that is cached now (whole blocks; empty
        when the first is not cached). Chained hashes: a block's hash covers every token before it, so these are
        exactly the prefix's tokens."""
        out: list[int] = []
        for h in kvmesh_hashes:
            tokens = self._tokens.get(h)
            if tokens is None:
                break
            out.extend(tokens)
        return out

    def _event(self, kind: KvEventKind, hashes: list[int] | None = None, parent: int | None = None) -> KvEvent:
        self.last_event_id += 1
        return KvEvent(
            event_id=self.last_event_id,
            kind=kind,
            block_hashes=hashes or [],
            parent_hash=parent,
            num_tokens_per_block=self.block_size if kind is KvEventKind.BLOCK_STORED else 0,
        )

    def _relevant(self, ev: Mapping[str, Any]) -> bool:
        # group_idx is omitted on the wire when None; models with one KV-cache group (every dense model) use 0.
        return ev.get("medium") in DEVICE_MEDIA and ev.get("group_idx") in (None, 0)

    def _stored(self, ev: Mapping[str, Any], out: list[KvEvent]) -> None:
        vllm_hashes = list(ev.get("block_hashes") or [])
        tokens = ev.get("token_ids") or []
        bs = ev.get("block_size")
        if not self._relevant(ev) or bs != self.block_size or len(tokens) != len(vllm_hashes) * self.block_size:
            self.num_skipped += 1
            logger.debug(
                "skipping BlockStored of %d blocks (%d tokens, block size %s)", len(vllm_hashes), len(tokens), bs
            )
            return
        if not vllm_hashes:
            return
        vllm_parent = ev.get("parent_block_hash")
        parent: int | None = None
        if vllm_parent is not None:
            mirrored = self._by_vllm_hash.get(vllm_parent)
            if mirrored is None:
                # Without the parent's kvmesh hash the chain cannot be continued; such blocks can never match a
                # router's prompt hashes anyway, so they are left out of the mirror and of the events.
                self.num_unknown_parents += 1
                logger.warning("BlockStored with an unknown parent block: %d blocks not announced", len(vllm_hashes))
                return
            parent = mirrored.kvmesh_hash
        ours = block_hashes(tokens, self.block_size, parent_hash=parent)
        bs = self.block_size
        for i, (vh, kh) in enumerate(zip(vllm_hashes, ours, strict=True)):
            if kh not in self._tokens:
                self._tokens[kh] = array.array("i", tokens[i * bs : (i + 1) * bs])
            m = self._by_vllm_hash.get(vh)
            if m is None:
                self._by_vllm_hash[vh] = _Mirrored(kh, 1)
            else:
                m.copies += 1
            self._copies[kh] = self._copies.get(kh, 0) + 1
        out.append(self._event(KvEventKind.BLOCK_STORED, ours, parent))

    def _removed(self, ev: Mapping[str, Any], out: list[KvEvent]) -> None:
        if not self._relevant(ev):
            self.num_skipped += 1
            return
        gone: list[int] = []
        for vh in ev.get("block_hashes") or []:
            m = self._by_vllm_hash.get(vh)
            if m is None:
                self.num_unknown_removals += 1
                continue
            m.copies -= 1
            if m.copies == 0:
                del self._by_vllm_hash[vh]
            left = self._copies[m.kvmesh_hash] - 1
            if left:
                self._copies[m.kvmesh_hash] = left
            else:
                del self._copies[m.kvmesh_hash]
                self._tokens.pop(m.kvmesh_hash, None)
                gone.append(m.kvmesh_hash)
        if gone:
            out.append(self._event(KvEventKind.BLOCK_REMOVED, gone))


# --- load -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class VllmStats:
    """The latest numbers from vLLM's stat-logger callbacks (duck-typed: ``SchedulerStats``, ``IterationStats``).

    vLLM records once per batch of engine-core outputs, i.e. about once per step while anything runs, and not at all
    while idle; its last record before going idle already shows 0 running, so the last values simply hold.

    Cumulative counters since the engine started: where prompt tokens came from (vLLM's ``PromptTokenStats``: computed
    here, found in this engine's prefix cache, or pulled from another engine by a KV connector), and the KV
    connector's transfers (NIXL's ``kv_connector_stats``: successful reads and their bytes, failures, and source
    blocks released because nobody pulled them before their lease ran out). They are what shows that a decode
    engine computed one token of a remotely prefilled prompt and pulled the rest.
    """

    num_total_blocks: int = 0  # usable blocks: vLLM's num_gpu_blocks minus its null block
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    batch_size: int = 0  # requests in the last step, from iteration details (0 when vLLM sent none)
    num_prefill_tokens: int | None = None  # prompt tokens in the last step, from the same details (None: none sent)
    num_records: int = 0
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_local_hit: int = 0
    num_prompt_tokens_external: int = 0  # loaded by the KV connector (pulled from another engine)
    num_kv_transfers: int = 0  # KV reads this engine completed as a target
    num_kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0  # summed duration of those reads, as NIXL measured them
    num_kv_transfer_failures: int = 0  # failed reads, handshakes and notifications
    num_kv_expired: int = 0  # requests whose kept blocks this engine (a source) freed unpulled, at lease end

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        self.num_records += 1
        if scheduler_stats is not None:
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            self.num_running = int(scheduler_stats.num_running_reqs)
            # "skipped" waiting requests are deferred (blocked on a transient constraint): still queued.
            self.num_waiting = int(scheduler_stats.num_waiting_reqs) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is not None and not getattr(details, "is_dummy", False):
                self.batch_size = int(details.num_ctx_requests) + int(details.num_generation_requests)
                ctx_tokens = getattr(details, "num_ctx_tokens", None)  # vLLM 0.32 sends it; a fake may not
                self.num_prefill_tokens = int(ctx_tokens) if ctx_tokens is not None else None
            self._record_kv_connector(getattr(scheduler_stats, "kv_connector_stats", None))
        if iteration_stats is not None:
            self.num_preemptions += int(iteration_stats.num_preempted_reqs)
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None:
                self.num_prompt_tokens_computed += int(prompt.computed)
                self.num_prompt_tokens_local_hit += int(prompt.local_cache_hit)
                self.num_prompt_tokens_external += int(prompt.external_kv_transfer)

    def _record_kv_connector(self, data: Any) -> None:
        """NIXL's per-interval observations (lists, one entry per event); another connector's payload has none of
        these keys and changes nothing."""
        if not isinstance(data, Mapping):
            return

        def entries(key: str) -> list[Any]:
            v = data.get(key)
            return v if isinstance(v, list) else []

        self.num_kv_transfers += len(entries("transfer_duration"))
        self.kv_transfer_s += float(sum(entries("transfer_duration")))
        self.num_kv_bytes_received += int(sum(entries("bytes_transferred")))
        self.num_kv_transfer_failures += sum(
            len(entries(k)) for k in ("num_failed_transfers", "num_failed_handshakes", "num_failed_notifications")
        )
        self.num_kv_expired += len(entries("num_kv_expired_reqs"))


@dataclasses.dataclass(slots=True)
class RequestProgress:
    """What the adapter itself knows of one in-flight request (vLLM's stats have no per-request token counts)."""

    num_prompt_tokens: int
    num_output_tokens: int = 0
    started: bool = False  # the first output arrived: the prompt is prefilled


def load_snapshot(stats: VllmStats, requests: Iterable[RequestProgress], now_s: float) -> LoadSnapshot:
    """A ``LoadSnapshot`` from vLLM's numbers plus the adapter's per-request counts.

    Two fields are derived, as vLLM publishes neither: ``num_waiting_prefill_tokens`` counts the prompts of requests
    with no output yet (prefix-cache hits are not subtracted: vLLM reports them with the first output), and
    ``num_kv_tokens`` the prompt plus output tokens of the requests that are decoding.
    """
    pending = 0
    kv_tokens = 0
    n = 0
    for r in requests:
        n += 1
        if r.started:
            kv_tokens += r.num_prompt_tokens + r.num_output_tokens
        else:
            pending += r.num_prompt_tokens
    total = stats.num_total_blocks
    return LoadSnapshot(
        now_s=now_s,
        kv_usage=stats.kv_usage,
        num_total_blocks=total,
        num_active_blocks=round(stats.kv_usage * total),
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_prefill_tokens=pending,
        num_preemptions=stats.num_preemptions,
        # An idle engine's last step says nothing about the next one (as in the mock engine).
        batch_size=(stats.batch_size or stats.num_running) if n else 0,
        num_kv_tokens=kv_tokens,
        num_prefill_tokens=(stats.num_prefill_tokens if n else 0),
    )
