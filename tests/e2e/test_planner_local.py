"""The planner on served graphs of simulated workers: real etcd, nats-server, circus, workers, frontend and the
``local`` connector (issue 14). Every load is bounded (a request count and a time), every wait polls for its event.

- ``graphs/mock_planner.yaml`` (the planner as one more watcher of the graph): a load that fills the KV cache
  scales the aggregated pool 1 -> 2, the new worker takes requests, and when the load drops to a trickle of short
  requests the pool goes back 2 -> 1: no request fails, no stream ends short, the removed worker counts no request
  after it left etcd, the other watchers keep their processes; TensorBoard, ``kvmesh status`` and ``/metrics`` say
  what happened.
- ``graphs/mock_disagg.yaml`` with a ``planner:`` section set by ``--set``: a burst of long prompts grows the
  prefill pool 1 -> 2; under a steady load the new prefill worker is removed while it prefills an item, which it
  finishes and acks: every request completes, nothing is redelivered.
- ``graphs/mock_agg.yaml`` and ``kvmesh planner --environment local`` started next to it: a watcher removed by hand
  is the planner's new starting point; a planner SIGKILLed while a worker drains leaves a stopped watcher that the
  next planner, reading the state file, removes.

Timings: pulls every 0.25 s and an adjustment every 2 s (4 s where a request must be in flight first; 1 s where a
planner only has to hold), so each test runs in about a minute on two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from components.deploy.circus import CircusController
from components.deploy.state import ProcessRecord, ServeState
from components.runtime import Runtime, RuntimeConfig
from tests.e2e.test_serve import ROOT, Serve, clean_env, http_get, kvmesh, run_kvmesh, serving
from tests.support.waiting import wait_until, wait_until_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "tiny-llama"


def log_time(line: str) -> float:
    """The time of a log line, in seconds (``2026-11-26 22:19:11,668 INFO ...``)."""
    stamp = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
    return time.mktime(stamp) + int(line[20:23]) / 1000


def sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


@dataclasses.dataclass
class Outcome:
    max_tokens: int
    sent: float = 0.0  # wall clock (time.time()) when sent
    first: float | None = None  # and when its first text arrived
    finish_reason: str | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    error: str = ""

    @property
    def complete(self) -> bool:
        return not self.error and self.finish_reason == "length" and self.completion_tokens == self.max_tokens


class Streams:
    """Streaming completions through the official openai client; every outcome kept."""

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
        self.outcomes: list[Outcome] = []
        self.sent = 0

    async def one(self, prompt: str, max_tokens: int) -> Outcome:
        out = Outcome(max_tokens, sent=time.time())
        self.outcomes.append(out)
        try:
            stream = await self.client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                out.chunks += 1
                if out.first is None and chunk.choices and chunk.choices[0].text:
                    out.first = time.time()
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    out.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    out.completion_tokens = chunk.usage.completion_tokens
        except (openai.APIError, openai.APIConnectionError) as e:
            out.error = f"{type(e).__name__}: {e}"
        return out

    async def run(
        self,
        concurrency: int,
        prompt: Callable[[int], str],
        max_tokens: int,
        until: Callable[[], bool],
        max_requests: int,
        max_s: float,
    ) -> None:
        """``concurrency`` streams at a time until ``until()`` holds, ``max_requests`` were sent or ``max_s`` passed
        (the requests in flight then finish)."""
        deadline = time.monotonic() + max_s

        async def lane() -> None:
            while not until() and self.sent < max_requests and time.monotonic() < deadline:
                self.sent += 1
                await self.one(prompt(self.sent), max_tokens)

        await asyncio.gather(*(lane() for _ in range(concurrency)))

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.complete]


def watcher_names(st: ServeState) -> list[str]:
    return [w.name for w in st.watchers]


def records(st: ServeState, names: list[str]) -> dict[str, list[ProcessRecord]]:
    return {n: st.watcher(n).processes for n in names}  # type: ignore[union-attr]


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of ``name{labels...}`` (labels matched as a subset) in a Prometheus exposition, None if absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def status_json(serve: Serve, ns: str) -> list[dict[str, Any]]:
    done = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", ns, "--json", "--load-wait-s", "0")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def instance_of(serve: Serve, ns: str, watcher: str) -> str:
    """The instance id (hex) of the worker a watcher runs, as kvmesh status shows it."""
    rows = [r for r in status_json(serve, ns) if r.get("watcher") == watcher and r["component"] == "backend"]
    assert len(rows) == 1, rows
    return str(rows[0]["instance_id"])


def read_scalars(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def decision_texts(acc: Any) -> list[str]:
    return [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("adjustment/decisions/text_summary")]


# -- the planner section of a graph: decode pool 1 -> 2 -> 1 --------------------------------------------------------

PLANNER_NS = "mock-planner"


def long_prompt(i: int, n: int = 300) -> str:
    """~n tokens (tiny-llama's tokenizer is byte-level), distinct per request: no prefix is shared."""
    head = f"request {i}: "
    return head + "abcdefghij"[i % 10] * (n - len(head))


async def test_graph_planner_scales_decode_up_under_kv_load_and_back_down_losing_nothing(tmp_path):
    tb = tmp_path / "tb"
    # 64 blocks x 16 tokens = 1024 tokens of KV per worker; a request is ~300 prompt + 400 output tokens (44 blocks),
    # so four at a time keep one worker's cache full (its mean KV use > 0.6), and one short request at a time
    # (~36 tokens, 3 blocks) keeps it near 0.05 (< 0.2). The GPU budget (2; a simulated worker counts as 1) stops the
    # pool at 2.
    args = sets(
        "frontend.port=0",
        "frontend.router_policy=round_robin",
        "workers[0].num_gpu_blocks=64",
        "workers[0].max_model_len=1024",
        "planner.adjustment_interval=2",
        "planner.metric_pulling_interval=0.25",
        "planner.decode_kv_scale_up_threshold=0.6",
        "planner.decode_kv_scale_down_threshold=0.2",
        "planner.max_gpu_budget=2",
        f"planner.log_dir={tb}",
    )
    new, first = f"{PLANNER_NS}-mock-1", f"{PLANNER_NS}-mock-0"
    others = [f"{PLANNER_NS}-frontend", first, f"{PLANNER_NS}-planner"]
    with serving(tmp_path / "state", *args, graph=ROOT / "graphs" / "mock_planner.yaml") as serve:
        url = serve.wait_ready()
        st0 = serve.state(PLANNER_NS)
        assert watcher_names(st0) == others[:2] + others[2:]  # frontend, mock-0, planner
        before = records(st0, others)
        streams = Streams(url)

        # Phase 1: fill the KV cache until the new worker has served two requests.
        served_by_new: dict[str, str] = {}

        def new_worker_served() -> bool:
            st = serve.state(PLANNER_NS)
            w = st.watcher(new)
            if w is None or not w.processes:
                return False
            if "id" not in served_by_new:
                with contextlib.suppress(AssertionError):
                    served_by_new["id"] = instance_of(serve, PLANNER_NS, new)
                return False
            _, body = http_get(f"{url}/metrics")
            got = metric(body.decode(), "kvmesh_frontend_worker_requests_total", worker=served_by_new["id"])
            return (got or 0) >= 2

        flag = {"done": False}

        async def watch_phase1() -> None:
            while not flag["done"]:
                flag["done"] = await asyncio.to_thread(new_worker_served)
                await asyncio.sleep(0.2)

        watcher = asyncio.ensure_future(watch_phase1())
        await streams.run(4, long_prompt, 400, lambda: flag["done"], max_requests=80, max_s=120)
        watcher.cancel()
        assert flag["done"], f"the new worker did not serve requests; planner log:\n{planner_log(serve)}"
        victim = served_by_new["id"]
        assert [w.name for w in serve.state(PLANNER_NS).watchers] == [others[0], first, others[2], new]

        # Phase 2: a trickle of short requests until the pool is back at one worker. Meanwhile, follow (every
        # 20 ms) whether the victim is still registered in etcd, and its request count at the frontend.
        gone = {"at": 0.0}
        counts: list[tuple[float, float]] = []
        rt = await Runtime.connect(RuntimeConfig(etcd_endpoints=st0.etcd_endpoints, nats_url=st0.nats_url))

        def count() -> None:
            _, body = http_get(f"{url}/metrics")
            got = metric(body.decode(), "kvmesh_frontend_worker_requests_total", worker=victim) or 0
            counts.append((time.monotonic(), got))

        def removed() -> bool:
            return serve.state(PLANNER_NS).watcher(new) is None

        async def follow() -> None:
            while not removed():
                if not gone["at"]:
                    ids = {f"{i.instance_id:x}" for i in await rt.namespace(PLANNER_NS).list_instances()}
                    if victim not in ids:
                        gone["at"] = time.monotonic()
                await asyncio.to_thread(count)
                await asyncio.sleep(0.02)

        try:
            follower = asyncio.ensure_future(follow())
            await streams.run(1, lambda i: f"short {i}", 16, removed, max_requests=400, max_s=90)
            await asyncio.wait_for(follower, 30)
        finally:
            await rt.shutdown(drain_timeout_s=1.0)
        # The victim may drain and exit within 200 ms of leaving etcd (seen: 0.3 s from SIGTERM to its removal),
        # before the follower took a count past that window: take the last one after it (a time window, no event).
        if gone["at"]:
            await asyncio.sleep(max(0.0, gone["at"] + 0.25 - time.monotonic()))
        await asyncio.to_thread(count)
        assert removed(), f"the pool did not scale back down; planner log:\n{planner_log(serve)}"

        # Nothing failed and no stream ended short, through both changes.
        assert streams.failures() == [] and len(streams.outcomes) >= 10
        # The removed worker took requests, and none after it left etcd (200 ms: a request sent just before has
        # its first output, which the frontend counts, within a few ms).
        assert gone["at"], "the victim never left etcd while followed"
        after = [c for t, c in counts if t >= gone["at"] + 0.2]
        assert counts[-1][1] >= 2 and after and set(after) == {counts[-1][1]}
        # A request the frontend sent in the moment between the victim starting to drain and the frontend hearing
        # of it is refused by the victim ("is draining") and goes to the other worker (no client saw it: above).
        # Nothing else may have failed there, and no refusal may come later than that moment.
        frontend_log = (serve.state_dir / "logs" / f"{PLANNER_NS}-frontend.log").read_text().splitlines()
        failed = [line for line in frontend_log if f"worker {victim} failed" in line]
        assert all(f"instance {victim} is draining" in line for line in failed), failed
        # The frontend hears that the victim takes no new requests (NATS), or that it left (etcd), whichever comes
        # first: under load the second can come first, and then the first is not logged (a departed worker's late
        # status is ignored), as a two-worker suite run saw.
        heard = [
            log_time(line)
            for line in frontend_log
            if f"worker {victim} takes no new requests" in line
            or ("left: " in line and victim in line.split("left: ")[1])
        ]
        assert heard and all(log_time(line) <= min(heard) + 1.0 for line in failed), (victim, heard, failed)
        # The other watchers kept their processes; the state file is back to the graph's watchers.
        st1 = serve.state(PLANNER_NS)
        assert watcher_names(st1) == others
        assert records(st1, others) == before and all(p.alive() for ps in before.values() for p in ps)

        # What the planner says about it: kvmesh status, /metrics, TensorBoard.
        # The pools are counted from the registrations, the planner's line is its published status: no load window.
        table = run_kvmesh(
            "status", "--state-dir", str(serve.state_dir), "--namespace", PLANNER_NS, "--load-wait-s", "0"
        ).stdout
        assert f"{PLANNER_NS}: pools {MODEL}: aggregated 1 worker" in table
        head = f"{PLANNER_NS}: planner {MODEL} (load mode, local connector"
        line = next(x for x in table.splitlines() if x.startswith(head))
        assert "last decision" in line and "decode: " in line
        metrics_url = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", line)
        assert metrics_url is not None, line
        _, body = http_get(metrics_url.group(1))
        text = body.decode()
        for direction in ("up", "down"):
            assert metric(text, "kvmesh_planner_changes_total", direction=direction, outcome="done") == 1.0
            assert (metric(text, "kvmesh_planner_decisions_total", direction=direction, pool="decode") or 0) >= 1
        assert metric(text, "kvmesh_planner_changes_total", outcome="failed") is None
        assert metric(text, "kvmesh_planner_workers", pool="decode") == 1.0

    acc = read_scalars(tb)
    workers = [e.value for e in acc.Scalars("pull/decode_workers")]
    # serve starts the planner with the workers, and its first pulls can come before the first worker registered
    # (0 workers: the planner holds on missing metrics). Since tensorboardX no longer imports torch, the planner is
    # up ~2 s sooner than before, and a loaded run saw a 0 first. From the first worker seen: 1, then 2, then 1.
    seen = list(itertools.dropwhile(lambda n: n == 0, workers))
    assert seen[0] == 1 and max(seen) == 2 and seen[-1] == 1, workers
    assert max(e.value for e in acc.Scalars("adjustment/kv_usage")) > 0.6
    assert {"pull/kv_usage", "pull/running_requests", "pull/waiting_requests", "pull/gpus"} <= set(
        acc.Tags()["scalars"]
    )
    texts = decision_texts(acc)
    assert any("decode: scale up 1 -> 2" in t for t in texts)
    assert any("decode: scale down 2 -> 1" in t for t in texts)


def planner_log(serve: Serve, ns: str = PLANNER_NS) -> str:
    path = serve.state_dir / "logs" / f"{ns}-planner.log"
    return path.read_text()[-4000:] if path.exists() else "(no planner log)"


# -- disaggregated: prefill pool 1 -> 2 -> 1, the leaving prefill worker mid-item ----------------------------------

DISAGG_NS = "mock-disagg"


def disagg_prompt(i: int) -> str:
    return long_prompt(i, 1200)  # > max_local_prefill_length (100): always prefilled remotely


async def test_a_prefill_burst_grows_the_prefill_pool_and_a_prefill_worker_leaving_mid_item_loses_nothing(tmp_path):
    # One prefill worker whose 1200-token prefill takes ~1 s (the step-time model's 34.7 ms at speedup 0.035), one
    # decode worker that sends every long prompt through the queue (threshold 100 tokens, queue up to 64 items).
    # Prefill thresholds: up above 2 items waiting per prefill worker, down below 0.6. A burst of 12 makes ~10
    # waiting on one worker: up (its trend, -1 item/s, still leaves ~3 per worker 3 intervals on). Then 3 requests
    # at a time on 2 prefill workers: both always hold an item and ~1 waits (0.5 per worker < 0.6): down, and the
    # worker removed is prefilling an item when it is told to leave. The decode pool holds (thresholds 0 / 0.99);
    # the budget (1 decode + 2 prefill, simulated workers count 1 GPU) caps the prefill pool at 2.
    args = sets(
        "frontend.port=0",
        "workers[0].replicas=1",
        "workers[0].speedup_ratio=0.035",
        "workers[1].num_workers=1",
        "workers[1].max_local_prefill_length=100",
        "workers[1].max_prefill_queue_size=64",
        "workers[1].remote_prefill_timeout_s=120",
        "planner.adjustment_interval=2",
        "planner.metric_pulling_interval=0.25",
        "planner.prefill_queue_scale_up_threshold=2",
        "planner.prefill_queue_scale_down_threshold=0.6",
        "planner.decode_kv_scale_up_threshold=0.99",
        "planner.decode_kv_scale_down_threshold=0",
        "planner.max_gpu_budget=3",
    )
    new = f"{DISAGG_NS}-prefill-1"
    with serving(tmp_path / "state", *args, graph=ROOT / "graphs" / "mock_disagg.yaml") as serve:
        url = serve.wait_ready()
        st0 = serve.state(DISAGG_NS)
        others = watcher_names(st0)
        assert others == [
            f"{DISAGG_NS}-frontend",
            f"{DISAGG_NS}-prefill-0",
            f"{DISAGG_NS}-decode-0",
            f"{DISAGG_NS}-planner",
        ]
        before = records(st0, others)
        streams = Streams(url)

        def grown() -> bool:
            w = serve.state(DISAGG_NS).watcher(new)
            return w is not None and bool(w.processes)

        def removed_after_growing() -> bool:
            return seen["grown"] and serve.state(DISAGG_NS).watcher(new) is None

        seen = {"grown": False}

        async def follow() -> None:
            while not removed_after_growing():
                seen["grown"] = seen["grown"] or await asyncio.to_thread(grown)
                await asyncio.sleep(0.1)

        follower = asyncio.ensure_future(follow())
        burst = asyncio.ensure_future(asyncio.gather(*(streams.one(disagg_prompt(1000 + i), 8) for i in range(12))))
        steady = streams.run(3, disagg_prompt, 8, removed_after_growing, max_requests=120, max_s=150)
        await asyncio.gather(burst, steady)
        await asyncio.wait_for(follower, 30)
        assert seen["grown"], f"the prefill pool did not grow; planner log:\n{planner_log(serve, DISAGG_NS)}"
        assert removed_after_growing(), (
            f"the prefill pool did not shrink; planner log:\n{planner_log(serve, DISAGG_NS)}"
        )

        # Every request completed whole, the burst's and those in flight while the prefill worker left.
        assert streams.failures() == [] and len(streams.outcomes) >= 15
        # The leaving worker was prefilling an item; it finished it (delivered, acked) before it exited.
        victim_log = (serve.state_dir / "logs" / f"{new}.log").read_text()
        assert "stopping: finishing the item in hand first" in victim_log, victim_log[-3000:]
        assert "the item in hand is done" in victim_log
        _, body = http_get(f"{url}/metrics")
        text = body.decode()
        assert metric(text, "kvmesh_frontend_prefill_queue_redelivered", model=MODEL) == 0.0
        await wait_until(
            lambda: metric(http_get(f"{url}/metrics")[1].decode(), "kvmesh_frontend_prefill_queue_waiting") == 0.0,
            timeout_s=20,
            step_s=0.2,
        )
        st1 = serve.state(DISAGG_NS)
        assert watcher_names(st1) == others
        assert records(st1, others) == before
        assert "prefill pool: retiring " + new in planner_log(serve, DISAGG_NS)


# -- kvmesh planner next to kvmesh serve: hand-removed watcher, a planner killed mid-way ----------------------------

AGG_NS = "mock"


@contextlib.contextmanager
def planner_process(serve: Serve, log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvmesh planner --environment local`` for ``mock``; etcd and NATS come from the state file (no KVMESH_*)."""
    cmd = kvmesh("--log-level", "INFO", "planner", "--namespace", AGG_NS, "--served-model-name", MODEL)
    cmd += ["--environment", "local", "--state-dir", str(serve.state_dir), "--metric-pulling-interval", "0.25"]
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [*cmd, *flags], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"READY planner {AGG_NS}/{MODEL} (local), metrics http://127.0.0.1:"), (
            line + log.read_text()[-3000:]
        )
        yield proc, line.split("metrics ", 1)[1].strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def planner_says(serve: Serve, pattern: str) -> bool:
    table = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", AGG_NS, "--load-wait-s", "0")
    return any(re.search(pattern, x) for x in table.stdout.splitlines() if x.startswith(f"{AGG_NS}: planner"))


async def test_a_hand_removed_watcher_is_the_new_start_and_a_restarted_planner_resumes_from_the_state_file(tmp_path):
    # Speedup 0.5: a decode step of the step-time model (~5 ms) takes ~10 ms, so a 1500-token request streams for
    # ~15 s: still in flight when a planner started after it has decided (start-up, ~2-4 s, + one 4 s interval;
    # asserted below). At 0.25 it streamed ~30 s, of which ~20 s were waiting for it to end.
    args = sets(
        "frontend.port=0",
        "frontend.router_policy=round_robin",
        "workers[0].replicas=3",
        "workers[0].num_workers=1",
        "workers[0].speedup_ratio=0.5",
    )
    log = tmp_path / "planner.log"
    names = [f"{AGG_NS}-frontend", f"{AGG_NS}-mock-0", f"{AGG_NS}-mock-1", f"{AGG_NS}-mock-2"]
    with serving(tmp_path / "state", *args) as serve:
        url = serve.wait_ready()
        st = serve.state(AGG_NS)
        assert watcher_names(st) == names
        keep = records(st, names[:2])
        assert st.circus is not None
        circus = CircusController(st.circus.endpoint)

        # A person removes mock-2 by hand (circusctl rm): serve's state file drops it.
        await asyncio.to_thread(circus.remove, names[3])
        wait_until_sync(lambda: watcher_names(serve.state(AGG_NS)) == names[:3], timeout_s=10)
        # The local connector reads the pool as it now is (Connector.pool_size): 2 active watchers of 1 worker each.
        from components.planner.connectors.local import LocalConnector
        from components.planner.policy import Pool

        local = LocalConnector(None, AGG_NS, MODEL, serve.state_dir)  # type: ignore[arg-type]
        assert await local.pool_size(Pool.DECODE) == 2
        assert await local.pool_size(Pool.PREFILL) == 0

        # A planner that holds an idle pool (down-threshold 0) takes 2 workers as its start, and adds nothing back:
        # three adjustments, each a hold at 2. An adjustment every second (4 pulls each): a hold needs no longer,
        # and three of them took 6 s at 2 s.
        flags = ("--adjustment-interval", "1", "--decode-kv-scale-down-threshold", "0")
        with planner_process(serve, log, *flags) as (_, metrics_url):

            def adjustments() -> float:
                return metric(http_get(metrics_url)[1].decode(), "kvmesh_planner_adjustments_total") or 0

            await wait_until(lambda: adjustments() >= 3, timeout_s=30, step_s=0.2)
            text = http_get(metrics_url)[1].decode()
            # Both counts from one scrape: a second scrape could come an adjustment later (a second apart).
            holds = metric(text, "kvmesh_planner_decisions_total", direction="hold")
            assert holds == metric(text, "kvmesh_planner_adjustments_total") and holds is not None and holds >= 3
            assert metric(text, "kvmesh_planner_workers", pool="decode") == 2.0
            assert planner_says(serve, r"decode: hold at 2 ")
        assert watcher_names(serve.state(AGG_NS)) == names[:3]

        # Two long requests, one on each worker (round robin); then a planner that scales the idle-ish pool down
        # (its KV use is far under 0.2) retires mock-1, whose request is still streaming: killed mid-drain.
        streams = Streams(url)
        long_requests = asyncio.ensure_future(asyncio.gather(*(streams.one(f"long {i}", 1500) for i in range(2))))
        await wait_until(lambda: len(streams.outcomes) == 2 and all(o.chunks for o in streams.outcomes), 30)
        with planner_process(serve, log, "--adjustment-interval", "4") as (doomed, _):
            await wait_until(lambda: f"retiring {names[2]}: SIGTERM" in log.read_text(), timeout_s=30, step_s=0.05)
            assert not long_requests.done()  # its request still streams: a drain, not an idle exit
            doomed.kill()
            doomed.wait(10)
        assert serve.state(AGG_NS).watcher(names[2]) is not None  # not removed: the planner died first
        outcomes = await asyncio.wait_for(long_requests, 90)
        assert [o.complete for o in outcomes] == [True, True], outcomes  # the draining worker finished its request
        # Its process exited and circus did not start another (the hook the planner set): a stopped watcher.
        await wait_until(lambda: circus.statuses().get(names[2]) == "stopped", timeout_s=20, step_s=0.1)
        assert circus.pids(names[2]) == []

        # The next planner reads the fleet from the state file and circus: it removes the stopped watcher and holds
        # (an adjustment every second, as the first planner's holds).
        with planner_process(serve, log, "--adjustment-interval", "1"):
            wait_until_sync(lambda: watcher_names(serve.state(AGG_NS)) == names[:2], timeout_s=20)
            await wait_until(lambda: planner_says(serve, r"decode: hold at 1 "), timeout_s=30, step_s=0.3)
        assert "pool: removing stopped watcher mock-mock-1" in log.read_text()
        assert records(serve.state(AGG_NS), names[:2]) == keep
