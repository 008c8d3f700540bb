"""Smoke test: vLLM V1 ``AsyncLLM`` serving models/tiny-llama in-process on this CPU-only machine.

What it checks, in order, printing ``name: value`` lines and one ``check NAME: ok`` line per check
(docs/vllm-cpu.md quotes the numbers):

1. start-up: ``AsyncLLM.from_engine_args`` wall time, resident memory of this process and its children, idle CPU;
2. greedy determinism: prompt A alone, A again (a prefix-cache hit), then A and B batched together; the token streams
   must not change;
3. a stop token ends the stream with ``finish_reason == "stop"``;
4. stats: a custom ``StatLoggerBase`` sees KV-cache usage, running/waiting counts and preemptions;
5. abort: ``engine.abort(request_id)`` ends a long request's stream early;
6. pressure: 8 long requests on a 63-block KV cache force preemptions and evictions, and greedy output still matches;
7. KV events: a zmq SUB socket receives ``BlockStored`` and ``BlockRemoved`` events, decoded with vLLM's own msgspec
   types, with consecutive sequence numbers, the first carrying exactly the prompt's full blocks.

Exits non-zero on the first failed check. Runs with the vLLM venv (scripts/install_vllm_cpu.sh) after
scripts/make_tiny_weights.py::

    /tmp/vllm-venv/bin/python scripts/vllm_smoke.py [--threads 1] [--kv-cache-mib 4]

The ``if __name__ == "__main__"`` guard at the bottom is required, not habit: vLLM's CPU platform starts its
engine-core process with ``spawn``, which re-imports this module.

This is a script, not a test module: the engine adapter's tests (marker ``vllm``) replace it. Its environment settings
are the ones the adapter needs, so they live at the top where a reader finds them first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"


def configure_env(threads: int) -> None:
    """Environment that must be set before vLLM is imported (vllm.envs reads it lazily, but torch reads OMP_* once)."""
    # vLLM asks for "this node's IP" for its ZMQ sockets and the KV-event "tcp://*:0" bind: keep both on loopback.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # "auto" pins the worker's OpenMP threads to all cores but one (the one reserved for the engine-core process), so
    # two workers on a 2-core box would both pin to core 0. "nobind" + a small OMP_NUM_THREADS lets the kernel share.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tree_rss_mib() -> dict[str, float]:
    import psutil

    me = psutil.Process()
    out = {f"pid {me.pid} (this process)": me.memory_info().rss / 2**20}
    for child in me.children(recursive=True):
        try:
            out[f"pid {child.pid} ({child.name()})"] = child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def make_stat_logger_class() -> type:
    """A per-engine stat logger that keeps the latest scheduler numbers; the adapter's LoadSnapshot comes from here."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        latest: SnapshotStatLogger | None = None  # the smoke test reads the one instance the engine made

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self.num_blocks = vllm_config.cache_config.num_gpu_blocks
            self.block_size = vllm_config.cache_config.block_size
            self.kv_cache_usage = 0.0
            self.num_running = 0
            self.num_waiting = 0
            self.num_preemptions = 0  # cumulative
            self.num_records = 0
            self.max_running = 0
            self.max_kv_cache_usage = 0.0
            type(self).latest = self

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            self.num_records += 1
            if scheduler_stats is not None:
                self.kv_cache_usage = scheduler_stats.kv_cache_usage
                self.num_running = scheduler_stats.num_running_reqs
                self.num_waiting = scheduler_stats.num_waiting_reqs
                self.max_running = max(self.max_running, self.num_running)
                self.max_kv_cache_usage = max(self.max_kv_cache_usage, self.kv_cache_usage)
            if iteration_stats is not None:
                self.num_preemptions += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            # Called once after start-up. Nothing to do: num_gpu_blocks was already filled in (from the engine core's
            # ready handshake) when __init__ ran.
            pass

    return SnapshotStatLogger


class EventCollector:
    """Subscribes to the engine's KV-event publisher on a background thread (zmq is blocking here; simple)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.endpoint = endpoint
        self.batches: list[tuple[int, Any]] = []  # (sequence number, KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")  # all topics; vLLM's default topic is ""
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            _topic, seq_bytes, payload = self._sock.recv_multipart()
            self.batches.append((int.from_bytes(seq_bytes, "big"), decoder.decode(payload)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


async def generate(engine: Any, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str, float]:
    """Greedy generation; returns (token ids, finish reason, time to first token in s)."""
    result = await generate_full(engine, request_id, prompt, max_tokens)
    return result["tokens"], result["finish_reason"], result["ttft_s"]


async def generate_full(engine: Any, request_id: str, prompt: list[int], max_tokens: int, **sampling: Any) -> dict:
    """Greedy generation streamed as deltas; returns tokens, finish/stop reason, cached prompt tokens and TTFT."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    sampling.setdefault("ignore_eos", True)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, detokenize=False, **sampling
    )
    result: dict[str, Any] = {"tokens": [], "finish_reason": None, "stop_reason": None, "num_cached_tokens": None}
    t0 = time.perf_counter()
    result["ttft_s"] = -1.0
    # tokens_input() builds {"type": "token", "prompt_token_ids": [...]}: the engine-input form that skips the
    # deprecated raw-prompt path (a TokensPrompt also works but logs a deprecation warning once).
    async for out in engine.generate(tokens_input(prompt), params, request_id):
        completion = out.outputs[0]
        if result["num_cached_tokens"] is None:
            result["num_cached_tokens"] = out.num_cached_tokens  # set on the first output of the request
        if result["ttft_s"] < 0 and completion.token_ids:
            result["ttft_s"] = time.perf_counter() - t0
        result["tokens"].extend(completion.token_ids)
        if out.finished:
            result["finish_reason"] = completion.finish_reason
            result["stop_reason"] = completion.stop_reason
    return result


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"check {name}: {'ok' if ok else 'FAILED'}{(' - ' + detail) if detail else ''}", flush=True)
    if not ok:
        raise SystemExit(1)


def cpu_seconds() -> dict[int, float]:
    import psutil

    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    return {p.pid: p.cpu_times().user + p.cpu_times().system for p in procs}


async def run(args: argparse.Namespace) -> None:
    t_import = time.perf_counter()
    from vllm import AsyncEngineArgs
    from vllm.config import KVEventsConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    print(f"import_vllm_s: {time.perf_counter() - t_import:.1f}", flush=True)

    stat_logger_cls = make_stat_logger_class()
    engine_args = AsyncEngineArgs(
        model=str(args.model),
        skip_tokenizer_init=True,  # token ids in, token ids out: the frontend owns the tokenizer
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=2048,
        # One 32-token block of this model is 2 layers x (K, V) x 2 kv heads x 64 dims x 32 tokens x 4 bytes = 64 KiB,
        # so 4 MiB is 64 blocks, 63 usable (vLLM keeps one null block): 2016 tokens, small enough to preempt below.
        kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
        block_size=args.block_size,
        enable_prefix_caching=True,
        enforce_eager=True,  # no torch.compile/inductor: start-up in seconds, not minutes
        seed=0,
        disable_log_stats=True,  # no default LoggingStatLogger; our custom logger still gets stats
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            # "*:0" binds an ephemeral port on VLLM_HOST_IP; get_kv_event_sources() reports the resolved endpoint.
            endpoint="tcp://*:0",
            topic="kv",
        ),
    )
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[stat_logger_cls])
    print(f"startup_s: {time.perf_counter() - t0:.1f}", flush=True)
    try:
        await exercise(engine, args, stat_logger_cls)
    finally:
        t = time.perf_counter()
        engine.shutdown()
        print(f"shutdown_s: {time.perf_counter() - t:.1f}", flush=True)
        # Drop the last reference while the interpreter is whole: AsyncLLM.__del__ calls shutdown() again, and at
        # interpreter exit its module globals are already None ("TypeError: 'NoneType' object is not callable").
        del engine


async def exercise(engine: Any, args: argparse.Namespace, stat_logger_cls: Any) -> None:
    rss = tree_rss_mib()
    for who, mib in rss.items():
        print(f"rss_mib {who}: {mib:.0f}")
    print(f"rss_mib total: {sum(rss.values()):.0f}", flush=True)
    cache = engine.vllm_config.cache_config
    print(f"num_gpu_blocks: {cache.num_gpu_blocks} block_size: {cache.block_size}", flush=True)

    # Idle cost: the worker busy-polls its shared-memory queue for 1 s after its last read, then sleeps on a socket.
    await asyncio.sleep(2)
    before = cpu_seconds()
    await asyncio.sleep(args.idle_probe_s)
    after = cpu_seconds()
    idle = {pid: 100 * (after[pid] - before[pid]) / args.idle_probe_s for pid in before if pid in after}
    print(f"idle_cpu_percent by pid: { {pid: round(v, 1) for pid, v in idle.items()} }", flush=True)

    endpoint = engine.engine_core.get_kv_event_sources()[0].endpoint
    print(f"kv_events_endpoint: {endpoint}", flush=True)
    events = EventCollector(endpoint)
    await asyncio.sleep(0.5)  # PUB/SUB "slow joiner": a subscriber misses what is sent before it connects

    prompt_a = list(range(10, 10 + args.prompt_len))  # 100 tokens = 3 full blocks of 32 + 4
    prompt_b = [(7 * i + 3) % 256 for i in range(args.prompt_len)]
    n = args.max_tokens

    t = time.perf_counter()
    a1, fin, ttft = await generate(engine, "a1", prompt_a, n)
    dt = time.perf_counter() - t
    print(f"a1 ({fin}, ttft {ttft * 1000:.0f} ms, {len(a1) / dt:.0f} tok/s): {a1}", flush=True)
    r = await generate_full(engine, "a2", prompt_a, n)
    check("same greedy output twice", r["tokens"] == a1)
    check("output is not a short cycle", len(set(a1)) > 8, f"{len(set(a1))} distinct ids in {len(a1)}")
    full_a = (len(prompt_a) // args.block_size) * args.block_size
    check(
        "repeat hits the prefix cache", r["num_cached_tokens"] == full_a, f"num_cached_tokens {r['num_cached_tokens']}"
    )

    t = time.perf_counter()
    (a3, _, _), (b1, _, _) = await asyncio.gather(
        generate(engine, "a3", prompt_a, n), generate(engine, "b1", prompt_b, n)
    )
    dt = time.perf_counter() - t
    print(f"batched a3+b1: {2 * n / dt:.0f} tok/s", flush=True)
    b2, _, _ = await generate(engine, "b2", prompt_b, n)
    check("batched greedy output equals unbatched", a3 == a1 and b1 == b2)

    # Stop tokens: the stop token is the last output token; finish_reason "stop", stop_reason the token id.
    r = await generate_full(engine, "stop", prompt_a, n, ignore_eos=False, stop_token_ids=[a1[5]])
    print(f"stop: {r['tokens']} finish {r['finish_reason']} stop_reason {r['stop_reason']}", flush=True)
    check("stop token ends the stream", r["tokens"] == a1[:6] and r["finish_reason"] == "stop")

    stats = stat_logger_cls.latest
    check("stat logger was called", stats is not None and stats.num_records > 0)
    print(
        f"stats: records {stats.num_records} num_blocks {stats.num_blocks} max_running {stats.max_running} "
        f"max_kv_cache_usage {stats.max_kv_cache_usage:.3f} kv_cache_usage_now {stats.kv_cache_usage:.3f} "
        f"running_now {stats.num_running} waiting_now {stats.num_waiting} preemptions {stats.num_preemptions}",
        flush=True,
    )
    check("stats saw two running requests", stats.max_running >= 2)

    # Abort: a request that would run 900 tokens, aborted after the first few arrive.
    got: list[int] = []
    finish: list[str] = []
    streaming = asyncio.Event()

    async def long_request() -> None:
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(tokens_input(prompt_b[:20]), params, "long"):
            got.extend(out.outputs[0].token_ids)
            if len(got) >= 5:
                streaming.set()
            if out.finished:
                finish.append(str(out.outputs[0].finish_reason))

    task = asyncio.create_task(long_request(), name="smoke-long-request")
    await asyncio.wait_for(streaming.wait(), timeout=30)
    t = time.perf_counter()
    await engine.abort("long")
    await asyncio.wait_for(task, timeout=10)
    print(
        f"abort: stream ended {1000 * (time.perf_counter() - t):.0f} ms after abort(), {len(got)} tokens, "
        f"final finish_reason {finish or 'none (generator just returned)'}",
        flush=True,
    )
    check("abort ended the stream early", len(got) < 900 and finish == ["abort"])
    await asyncio.sleep(0.5)
    check("nothing running after abort", stats.num_running == 0 and stats.kv_cache_usage == 0.0)

    # Pressure: 8 requests x (100 + 400) tokens need 8 x 16 = 128 blocks of the 63 there are, so the scheduler must
    # preempt (recompute) and evict cached blocks; greedy output must not change.
    pressure_prompts = [[(17 * i + 5 * j) % 256 for j in range(args.prompt_len)] for i in range(8)]
    t = time.perf_counter()
    results = await asyncio.gather(
        *(generate_full(engine, f"p{i}", p, args.pressure_tokens) for i, p in enumerate(pressure_prompts))
    )
    dt = time.perf_counter() - t
    print(
        f"pressure: {8 * args.pressure_tokens / dt:.0f} tok/s, preemptions {stats.num_preemptions}, "
        f"max_running {stats.max_running}, max_kv_cache_usage {stats.max_kv_cache_usage:.3f}",
        flush=True,
    )
    again = await generate_full(engine, "p0-again", pressure_prompts[0], args.pressure_tokens)
    check("greedy output unchanged by preemption", again["tokens"] == results[0]["tokens"])

    await asyncio.sleep(0.5)
    events.close()
    kinds: dict[str, int] = {}
    stored_tokens: list[list[int]] = []
    seqs = [seq for seq, _ in events.batches]
    for _seq, batch in events.batches:
        for ev in batch.events:
            kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
            if type(ev).__name__ == "BlockStored":
                stored_tokens.append(list(ev.token_ids))
    print(f"kv_events: {len(events.batches)} batches, seq {seqs[:1]}..{seqs[-1:]}, by kind {kinds}", flush=True)
    if events.batches:
        first = events.batches[0][1]
        print(f"kv_events first batch: ts={first.ts} dp_rank={first.data_parallel_rank} events={first.events[:2]}")
    check("BlockStored events arrived", kinds.get("BlockStored", 0) > 0)
    check("BlockRemoved events arrived under pressure", kinds.get("BlockRemoved", 0) > 0)
    check("event sequence numbers are consecutive", seqs == list(range(seqs[0], seqs[0] + len(seqs))))
    check(
        "first BlockStored carries prompt A's full blocks",
        stored_tokens[0][:full_a] == prompt_a[:full_a],
        f"{len(stored_tokens[0])} tokens",
    )
    check("pressure caused preemptions", stats.num_preemptions > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description="vLLM CPU smoke test on models/tiny-llama")
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the model worker")
    ap.add_argument("--kv-cache-mib", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32, help="the CPU attention backend needs a multiple of 32")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pressure-tokens", type=int, default=400)
    ap.add_argument("--idle-probe-s", type=float, default=3.0)
    args = ap.parse_args()
    if not (args.model / "model.safetensors").exists():
        print(f"no weights in {args.model}: run scripts/make_tiny_weights.py first", file=sys.stderr)
        return 2
    configure_env(args.threads)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
