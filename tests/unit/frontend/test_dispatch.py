"""The dispatch (components/frontend/dispatch.py): its retry rule (a failed worker's process is suspect, and a retry
goes to another process while one exists), and one request's life over the in-memory runtime: retries before the
first output, the router's bookkeeping settled for every attempt, and failover after it (re-issue as a continuation,
splice by position, migration_limit). The frontend's
integration tests run the rest over real etcd and NATS."""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from components.frontend.config import FrontendConfig
from components.frontend.dispatch import Dispatch, Interrupted, Suspects, avoid
from components.frontend.errors import ServiceUnavailableError, UpstreamError
from components.frontend.metrics import FrontendMetrics
from components.frontend.models import Model, ModelRegistry
from components.frontend.service import FrontendService, Generation, Prepared, RoutingHints
from components.frontend.tokenizer import Tokenizer, load_tokenizer
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import SamplingParams
from components.protocol.metadata import WorkerMetadata
from components.router import Router, RouteRequest
from components.router.types import RouteDecision
from components.runtime.errors import InstanceGoneError
from components.runtime.request_plane import RequestContext
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

# Two processes of 8 workers each on one node, and one worker on another node.
INSTANCES = {iid: ("node-a", 100) for iid in range(8)} | {iid: ("node-a", 200) for iid in range(8, 16)}
INSTANCES |= {16: ("node-b", 100)}


def process_of(info: tuple[str, int]) -> tuple[str, int]:
    return info


def test_a_retry_avoids_every_worker_of_the_process_that_failed():
    shunned = avoid(INSTANCES, {3}, {("node-a", 100)}, process_of)
    assert shunned == frozenset(range(8))
    # What is left: the other process on the same node, and the other node (same pid there: another process).
    assert set(INSTANCES) - shunned == set(range(8, 17))


def test_suspect_processes_are_only_avoided_while_another_can_serve():
    only_one = {iid: ("n", 1) for iid in range(4)}
    assert avoid(only_one, {0}, {("n", 1)}, process_of) == frozenset({0})  # better a suspect than no answer
    assert avoid(only_one, set(), set(), process_of) == frozenset()


def test_suspects_expire_and_an_anonymous_worker_makes_no_process_suspect():
    s = Suspects(hold_s=2.0)
    s.mark(("node-a", 100), now_s=10.0)
    s.mark(("", 0), now_s=10.0)  # no node/pid announced: nothing known to share its fault
    assert s.active(11.9) == {("node-a", 100)}
    assert s.active(12.0) == set()


# --- one request's life, over the in-memory runtime -------------------------------------------------------------------
#
# Scripted workers (a generate handler that plays a list of chunks) behind a real ModelRegistry and Router: each test
# checks what the client-facing Generation reads and that every attempt's router bookkeeping was settled.

MODEL_PATH = str(Path(__file__).resolve().parents[3] / "models" / "tiny-llama")
NS = "d"
A, B = 0xA1, 0xB2


def chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"token_ids": ids, "finish_reason": finish, "num_prompt_tokens": 0, "num_cached_tokens": 0}


class Scripted:
    """A worker's generate handler: plays ``chunks`` to every request, after ``skip`` of them (a worker that
    continues a request from a position); remembers the request ids it was sent."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.chunks = chunks
        self.request_ids: list[str] = []
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        self.request_ids.append(body["request_id"])
        self.bodies.append(body)
        for c in self.chunks:
            yield c


@dataclasses.dataclass
class Fleet:
    service: FrontendService
    model: Model
    tokenizer: Tokenizer
    workers: dict[int, Scripted]

    def prepared(self, rid: str, pin: int | None = None) -> Prepared:
        p = Prepared(rid, self.model, self.tokenizer, [104, 105], SamplingParams(16), [], time.monotonic())
        p.hints = RoutingHints(pinned_instance_id=pin)
        return p

    def dispatch(self, p: Prepared, cls: type[Dispatch] = Dispatch) -> Dispatch:
        s = self.service
        return cls(s.config, s.registry, s.router, s.suspects, p, s.metrics.model(p.model.name), on_retry=None)

    def active(self) -> dict[int, int]:
        return {iid: self.service.router.active_requests(iid) for iid in self.workers}

    def counted(self, name: str, **labels: str) -> float:
        """A sample of the frontend's metrics (0 if absent)."""
        value = self.service.metrics.registry.get_sample_value(name, {"model": "m", **labels})
        return 0.0 if value is None else value

    def placed(self) -> dict[int, tuple[float, float]]:
        """Per worker: requests and prompt tokens counted on it."""
        return {
            iid: (
                self.counted("kvmesh_frontend_worker_requests_total", worker=f"{iid:x}"),
                self.counted("kvmesh_frontend_worker_prompt_tokens_total", worker=f"{iid:x}"),
            )
            for iid in self.workers
        }


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(MODEL_PATH)


@pytest.fixture
async def make_fleet(tok: Tokenizer) -> AsyncIterator[Callable[[dict[int, list[dict[str, Any]]]], Awaitable[Fleet]]]:
    """A builder: workers (instance id -> script, each in a process of its own) behind a frontend's registry and
    router."""
    mesh = Mesh()
    registries: list[ModelRegistry] = []

    async def make(scripts: dict[int, list[dict[str, Any]]], router_cls: type[Router] = Router, **cfg: Any) -> Fleet:
        server = await mesh.runtime()
        endpoint = server.namespace(NS).component("backend").endpoint(ENDPOINT_GENERATE)
        workers: dict[int, Scripted] = {}
        for iid, chunks in scripts.items():
            meta = WorkerMetadata(model="m", model_path=MODEL_PATH, node="n", pid=iid, max_model_len=100)
            workers[iid] = Scripted(chunks)
            await endpoint.serve(workers[iid], metadata=meta.to_dict(), instance_id=iid)
        config = FrontendConfig(namespace=NS, max_retries=2, **cfg)
        router = router_cls(config)
        registry = ModelRegistry(await mesh.runtime(), NS, config.components, router, lambda path: tok)
        registries.append(registry)
        await registry.start()
        await wait_until(lambda: "m" in registry.models and len(registry.models["m"].instances) == len(scripts))
        service = FrontendService(config, registry, router, FrontendMetrics(policy=router.policy.name))
        return Fleet(service, registry.models["m"], tok, workers)

    yield make
    for registry in registries:
        await registry.close()
    await mesh.shutdown()


async def read_all(gen: Generation) -> str:
    return "".join([text async for text, _ in gen])


def generation(fleet: Fleet, d: Dispatch, first: dict[str, Any]) -> Generation:
    fleet.service.num_inflight += 1  # as FrontendService.start does; aclose() takes it back
    return Generation(fleet.service, d.prepared, d, first)


async def test_a_worker_that_aborts_before_any_output_reached_the_client_is_replaced(make_fleet):
    fleet = await make_fleet({A: [chunk([72, 73], "abort")], B: [chunk([104]), chunk([105], "length")]})
    # A's abort carries tokens, but none has reached the client: the request goes to B, unseen.
    d = fleet.dispatch(fleet.prepared("r1", pin=A))
    first = await d.start()
    assert first["token_ids"] == [104] and d.instance_id == B and d.num_attempts == 2
    # Each attempt had its own id (an engine refuses one it still holds) and A's was settled at once.
    assert (fleet.workers[A].request_ids, fleet.workers[B].request_ids) == (["r1"], ["r1.1"])
    assert fleet.active() == {A: 0, B: 1}
    assert fleet.service.suspects.active(time.monotonic()) == {("n", A)}  # A's process, for the next requests too
    gen = generation(fleet, d, first)
    assert await read_all(gen) == "hi" and gen.finish_reason == "length"
    await gen.aclose()
    assert fleet.active() == {A: 0, B: 0} and fleet.service.num_inflight == 0
    # Counted on B, where it ran, with its 2 prompt tokens; A's failed attempt counts nowhere. Both decisions are
    # counted: the pin on A, then round robin's turn once the pinned worker had been tried.
    assert fleet.placed() == {A: (0, 0), B: (1, 2)}
    decided = "kvmesh_frontend_routing_decisions_total"
    assert fleet.counted(decided, policy="round_robin", kind="pinned") == 1
    assert fleet.counted(decided, policy="round_robin", kind="rotation") == 1


async def test_cached_tokens_are_counted_on_the_worker_that_reported_them(make_fleet):
    # The engine's prefix-cache hit rides on the first chunk: 2 tokens, 1 of them loaded from its host-memory tier.
    first = chunk([104]) | {"num_cached_tokens": 2, "num_host_cached_tokens": 1}
    fleet = await make_fleet({A: [first, chunk([105], "length")], B: [chunk([104]), chunk([105], "length")]})
    for rid, pin in (("c1", A), ("c2", B), ("c3", A)):
        d = fleet.dispatch(fleet.prepared(rid, pin=pin))
        gen = generation(fleet, d, await d.start())
        await read_all(gen)
        await gen.aclose()
    cached = "kvmesh_frontend_worker_cached_tokens_total"
    assert (fleet.counted(cached, worker="a1"), fleet.counted(cached, worker="b2")) == (4, 0)
    host = "kvmesh_frontend_worker_host_cached_tokens_total"
    assert (fleet.counted(host, worker="a1"), fleet.counted(host, worker="b2")) == (2, 0)
    assert fleet.placed() == {A: (2, 4), B: (1, 2)}


async def test_a_request_no_worker_can_take_counts_one_nowhere_decision(make_fleet):
    fleet = await make_fleet({A: [chunk([], "abort")]})
    d = fleet.dispatch(fleet.prepared("n1"))
    with pytest.raises(ServiceUnavailableError):
        await d.start()
    # max_retries=2, but after A (the only worker) aborted there is nowhere left: one rotation, one nowhere.
    decided = "kvmesh_frontend_routing_decisions_total"
    assert fleet.counted(decided, policy="round_robin", kind="rotation") == 1
    assert fleet.counted(decided, policy="round_robin", kind="nowhere") == 1
    assert fleet.placed() == {A: (0, 0)}
    await d.close()


class Recording(Dispatch):
    """What the Generation hands the seam: the interruption and the position the client has reached."""

    resumed: list[tuple[str, int]] = []

    async def resume(self, interruption: Interrupted, position: int) -> dict[str, Any]:
        self.resumed.append((interruption.message, position))
        return await super().resume(interruption, position)


async def test_with_migration_limit_0_a_request_whose_worker_breaks_mid_stream_fails_with_a_clear_error(make_fleet):
    fleet = await make_fleet({A: [chunk([104]), chunk([105, 33]), chunk([], "abort")], B: [chunk([1], "length")]})
    fleet.service.config.migration_limit = 0
    d = fleet.dispatch(fleet.prepared("r2", pin=A), Recording)
    gen = generation(fleet, d, await d.start())
    texts = []
    with pytest.raises(UpstreamError, match="not re-issued elsewhere: migration_limit is 0"):
        async for text, _ in gen:
            texts.append(text)
    assert texts == ["h", "i!"]
    assert Recording.resumed == [("the worker aborted the request", 3)]
    await gen.aclose()
    assert fleet.active() == {A: 0, B: 0}
    assert fleet.workers[B].request_ids == []  # never tried elsewhere
    assert fleet.counted("kvmesh_frontend_migration_failures_total", reason="limit") == 1


def at(ids: list[int], position: int, finish: str | None = None) -> dict[str, Any]:
    return chunk(ids, finish) | {"position": position}


async def test_a_broken_upstream_is_re_issued_elsewhere_as_a_continuation_and_spliced_at_the_position(make_fleet):
    fleet = await make_fleet(
        {
            A: [at([104], 0), at([105], 1), chunk([], "abort")],
            # B continues from position 2 (it was sent prompt + the 2 outputs as a continuation).
            B: [at([33], 2), at([63], 3, "length")],
        }
    )
    d = fleet.dispatch(fleet.prepared("r3", pin=A))
    gen = generation(fleet, d, await d.start())
    assert await read_all(gen) == "hi!?" and gen.finish_reason == "length"
    assert gen.num_output_tokens == 4 and d.output_ids == [104, 105, 33, 63]  # h i from A, ! ? from B
    assert (fleet.workers[A].request_ids, fleet.workers[B].request_ids) == (["r3"], ["r3.1"])
    sent = fleet.workers[B].bodies[0]
    assert sent["token_ids"] == [104, 105, 104, 105] and sent["num_output_tokens"] == 2  # prompt + outputs
    assert d.instance_id == B and d.num_failovers == 1 and fleet.active() == {A: 0, B: 1}
    await gen.aclose()
    assert fleet.active() == {A: 0, B: 0}
    # It ran on both: counted once on each, with the prompt each was sent.
    assert fleet.placed() == {A: (1, 2), B: (1, 4)}
    assert fleet.counted("kvmesh_frontend_migrations_total", kind="failover") == 1


class PromptsSeen(Router):
    """A real router that remembers the prompt (``RouteRequest.token_ids``) of every ``prepare`` and ``select``."""

    def __init__(self, config: FrontendConfig) -> None:
        super().__init__(config)
        self.prepared: list[Any] = []
        self.selected: list[Any] = []

    def prepare(self, request: RouteRequest) -> RouteRequest:
        self.prepared.append(request.token_ids)
        return super().prepare(request)

    def select(self, request: RouteRequest) -> RouteDecision:
        self.selected.append(request.token_ids)
        return super().select(request)


async def test_a_kv_router_is_handed_the_prompt_packed_once_per_request_and_the_workers_get_lists(make_fleet):
    fleet = await make_fleet(
        {A: [at([104], 0), at([105], 1), chunk([], "abort")], B: [at([33], 2), at([63], 3, "length")]},
        PromptsSeen,
        router_policy="kv",
    )
    router = fleet.service.router
    assert isinstance(router, PromptsSeen) and router.uses_kv
    prompt = [104 + i % 7 for i in range(40)]  # two full 16-token blocks and a partial one
    p = Prepared("k1", fleet.model, fleet.tokenizer, prompt, SamplingParams(16), [], time.monotonic())
    p.hints = RoutingHints(pinned_instance_id=A)
    d = fleet.dispatch(p)
    gen = generation(fleet, d, await d.start())
    assert await read_all(gen) == "hi!?" and d.num_failovers == 1
    await gen.aclose()
    # The first placement: the prompt packed (an array('I'): its buffer is hashed as it is), packed once and kept
    # on the request (the same object for prepare and select); the re-issue: that buffer plus the 2 outputs.
    first, again = router.prepared
    assert type(first) is array and first.typecode == "I" and first is p.packed_prompt() and list(first) == prompt
    assert type(again) is array and again.typecode == "I" and list(again) == [*prompt, 104, 105]
    assert [x is y for x, y in zip(router.selected, (first, again), strict=True)] == [True, True]
    assert block_hashes(first, 16) == block_hashes(prompt, 16)  # 2 hashes, the same as the list's
    # The workers are sent lists, as before: the prompt, then prompt + outputs as a continuation.
    sent = [fleet.workers[A].bodies[0]["token_ids"], fleet.workers[B].bodies[0]["token_ids"]]
    assert [type(x) for x in sent] == [list, list] and sent == [prompt, [*prompt, 104, 105]]


async def test_a_non_kv_router_is_handed_the_list_and_nothing_is_packed(make_fleet):
    fleet = await make_fleet({A: [at([104], 0), at([105], 1, "length")]}, PromptsSeen)
    router = fleet.service.router
    assert isinstance(router, PromptsSeen) and not router.uses_kv
    p = fleet.prepared("k2")
    d = fleet.dispatch(p)
    gen = generation(fleet, d, await d.start())
    await read_all(gen)
    await gen.aclose()
    assert router.prepared == [[104, 105]] and router.prepared[0] is p.prompt_ids and p._packed is None


async def test_tokens_a_new_upstream_repeats_are_dropped_and_a_gap_is_an_interruption(make_fleet):
    fleet = await make_fleet(
        {
            # A skips position 2: the stream is cut there and the request re-issued from the 2 tokens the client has.
            A: [at([104], 0), at([105], 1), at([63], 3)],
            # B replays from position 1 (an overlap of one token): the client gets only what it lacks.
            B: [at([105, 33], 1), at([63], 3, "length")],
        }
    )
    d = fleet.dispatch(fleet.prepared("r4", pin=A))
    gen = generation(fleet, d, await d.start())
    assert await read_all(gen) == "hi!?"
    assert d.output_ids == [104, 105, 33, 63] and d.num_failovers == 1
    await gen.aclose()


async def test_no_other_worker_for_a_re_issue_is_a_service_unavailable_error_counted_as_nowhere(make_fleet):
    fleet = await make_fleet({A: [at([104], 0), chunk([], "abort")]})
    d = fleet.dispatch(fleet.prepared("r5"))
    gen = generation(fleet, d, await d.start())
    with pytest.raises(ServiceUnavailableError, match="already tried"):
        await read_all(gen)
    await gen.aclose()
    assert fleet.counted("kvmesh_frontend_migration_failures_total", reason="nowhere") == 1
    assert fleet.active() == {A: 0}


async def test_re_issues_stop_at_the_migration_limit(make_fleet):
    breaking = [at([104], 0), chunk([], "abort")]
    fleet = await make_fleet(
        {A: breaking, B: [at([105], 1), chunk([], "abort")], 0xC3: [at([33], 2), chunk([], "abort")]}
    )
    fleet.service.config.migration_limit = 2
    d = fleet.dispatch(fleet.prepared("r6", pin=A))
    gen = generation(fleet, d, await d.start())
    with pytest.raises(UpstreamError, match="re-issued 2 times"):
        await read_all(gen)
    assert d.output_ids == [104, 105, 33] and d.num_failovers == 2
    await gen.aclose()


# --- the request reports' counts (components/frontend/request_stats.py) ---------------------------------------------


async def test_a_request_counts_its_arrival_first_token_gaps_and_end_in_its_models_report(make_fleet):
    # Chunks of 2, 3 and 1 tokens: 6 output tokens, 5 gaps (one per token after the first); the 2 prompt tokens.
    fleet = await make_fleet({A: [chunk([104, 105]), chunk([106, 107, 108]), chunk([109], "length")]})
    book = fleet.service.request_stats
    p = fleet.prepared("s1")
    gen = await fleet.service.start(p)
    stats = book.model("m")
    assert (stats.requests, stats.prompt_tokens, stats.inflight, stats.finished) == (1, 2, 1, 0)
    await read_all(gen)
    await gen.aclose()
    fleet.service.observe(gen, fleet.service.metrics.model("m"))
    assert (stats.finished, stats.failed, stats.output_tokens, stats.inflight) == (1, 0, 6, 0)
    assert (stats.ttft_count, stats.itl_count) == (1, 5)
    # The TTFT is the Generation's own first-token time from arrival; the gaps sum to its last - first token.
    assert stats.ttft_sum_s == stats.ttft_max_s == gen.first_token_s - p.arrival_s
    assert stats.itl_sum_s == pytest.approx(gen.last_token_s - gen.first_token_s, abs=1e-12)
    assert 0 <= stats.itl_max_s <= stats.itl_sum_s


async def test_a_request_that_fails_before_its_first_token_counts_as_arrived_ended_and_failed(make_fleet):
    fleet = await make_fleet({A: [chunk([], "abort")], B: [chunk([], "abort")]})
    with pytest.raises(ServiceUnavailableError):
        await fleet.service.start(fleet.prepared("s2"))
    stats = fleet.service.request_stats.model("m")
    assert (stats.requests, stats.prompt_tokens, stats.finished, stats.failed, stats.inflight) == (1, 2, 1, 1, 0)
    assert (stats.output_tokens, stats.ttft_count, stats.itl_count) == (0, 0, 0)


async def test_a_generation_that_ends_without_a_finish_reason_counts_as_failed(make_fleet):
    fleet = await make_fleet({A: [chunk([104]), chunk([105]), chunk([106], "length")]})
    gen = await fleet.service.start(fleet.prepared("s3"))
    await gen.__anext__()  # the client left after the first token
    await gen.aclose()
    fleet.service.observe(gen, fleet.service.metrics.model("m"))
    stats = fleet.service.request_stats.model("m")
    assert (stats.finished, stats.failed, stats.output_tokens, stats.ttft_count, stats.itl_count) == (1, 1, 1, 1, 0)


class NoRespondersFirst(Dispatch):
    """The first ``gone`` attempts meet 'no responders' (nobody subscribed: a nats-server just restarted), the rest
    go through."""

    gone = 2

    async def _attempt(self, client: Any, body: dict[str, Any], iid: int) -> Any:
        if self.num_attempts <= self.gone:
            raise InstanceGoneError(iid, "no responders on its subject")
        return await super()._attempt(client, body, iid)


async def test_after_no_responders_the_next_attempt_waits_a_doubling_pause(make_fleet, monkeypatch):
    # Issue 28's CI run: 4 immediate attempts all met 'no responders' while the workers subscribed again to a
    # restarted nats-server, and the request failed. Now the dispatch pauses 0.1 s, then 0.2 s, between attempts.
    from components.frontend import dispatch as dispatch_module

    pauses: list[float] = []

    async def pause(s: float) -> None:
        pauses.append(s)

    monkeypatch.setattr(dispatch_module, "_pause", pause)
    script = [chunk([104]), chunk([105], "length")]
    fleet = await make_fleet({A: script, B: script, 0xC3: script})  # a third worker for the third attempt
    d = fleet.dispatch(fleet.prepared("nr1"), cls=NoRespondersFirst)
    first = await d.start()
    assert first["token_ids"] == [104] and d.num_attempts == 3
    assert pauses == [dispatch_module.NO_RESPONDERS_BACKOFF_S, 2 * dispatch_module.NO_RESPONDERS_BACKOFF_S]
    gen = generation(fleet, d, first)
    assert await read_all(gen) == "hi"
    await gen.aclose()


async def read_polling(gen: Generation) -> tuple[str, int]:
    """As the SSE writer reads (app.py): one item awaited, then every item that is here already taken with
    ``poll``. The text, and how many items ``poll`` gave."""
    texts, polled = [], 0
    async for text, finish in gen:
        texts.append(text)
        while finish is None:
            item = gen.poll()
            if item is None:
                break
            polled += 1
            text, finish = item
            texts.append(text)
    assert gen.poll() is None  # finished: nothing more, whatever is left on the stream
    return "".join(texts), polled


async def test_items_that_arrived_together_are_taken_by_poll_with_the_text_and_positions_awaiting_gives(make_fleet):
    fleet = await make_fleet({A: [at([104], 0), at([105], 1), at([33], 2), at([63], 3, "length")]})
    d = fleet.dispatch(fleet.prepared("p1"))
    gen = generation(fleet, d, await d.start())
    assert await read_polling(gen) == ("hi!?", 3) and gen.finish_reason == "length"
    assert d.output_ids == [104, 105, 33, 63] and gen.num_output_tokens == 4
    await gen.aclose()


async def test_what_poll_cannot_settle_is_left_to_next_item_which_splices_and_fails_over_as_before(make_fleet):
    # A gap (position 3 after 1), an overlap, and an abort: each left to next_item, which splices or fails over
    # exactly as when every item is awaited (the tests above).
    fleet = await make_fleet(
        {
            A: [at([104], 0), at([105], 1), at([63], 3)],
            B: [at([105, 33], 1), at([63], 3), chunk([], "abort")],
            0xC3: [at([42], 4, "length")],
        }
    )
    d = fleet.dispatch(fleet.prepared("p2", pin=A))
    gen = generation(fleet, d, await d.start())
    text, polled = await read_polling(gen)
    assert text == "hi!?*" and polled >= 1
    assert d.output_ids == [104, 105, 33, 63, 42] and d.num_failovers == 2 and gen.finish_reason == "length"
    await gen.aclose()
    assert fleet.active() == {A: 0, B: 0, 0xC3: 0}
