"""``kvmesh bench kv-transfer``: how soon a vLLM decode engine produces its own first token of a remotely prefilled
prompt when it pulls the prompt's KV (NIXL, ``remote_prefill_mode`` kv_transfer) against when it recomputes the
prompt (``recompute``), at several prompt lengths.

Two real vLLM engines run in this process, as a prefill worker's and a decode worker's (roles prefill and decode,
kvmesh's NIXL connector on both). One **sample** of a mode, for a prompt of ``n`` fresh random token ids:

* the prefill engine computes the prompt and its first token, as the prefill worker does for that mode: with
  ``prefill_handoff`` (the KV kept for a pull) for ``pull``, with a plain ``generate`` stopped at the first token
  for ``recompute``;
* the clock starts when that result is in hand, and the decode engine's ``generate_remote`` gets it (what the decode
  worker does once the result arrives over NATS; the NATS hop is not measured);
* the clock stops at the first token the decode engine produced itself: ``pull``: its first chunk (the KV pulled,
  the last prompt token computed, a token sampled); ``recompute``: its second chunk (the first is the prefill
  worker's token, streamed at once; the next one needs the prompt plus that token computed).

Each round takes one sample of each mode per length, in ABBA order (pull first in even rounds, recompute first in
odd ones), so drift of a shared 2-core machine falls on both modes alike; the ratio is recompute over pull, given as
the ratio of medians and as the median of the rounds' own ratios. Fresh prompts every sample: no prefix cache on
either engine holds any of it. A warm-up round (one sample of each mode per length, not counted) pays the first
NIXL handshake and vLLM's first-batch costs.

Evidence that a pull sample pulled: the decode engine's vLLM counters (prompt tokens from the connector, completed
KV reads and their bytes and duration: ``VllmStats``) are checked per sample; a sample whose read failed is counted
in ``pull_failures`` and left out of the figures.

The last line on stdout is one JSON object::

    {"bench": "kv-transfer", "lengths": {"512": {"pull_ms": {...}, "recompute_ms": {...}, "ratio_of_medians": ...,
     "median_round_ratio": ..., "kv_read_ms": {...}, "kv_bytes": ..., "prefill_ms": {...}}, ...}, ...}

Everything stays on loopback (NIXL's handshake listeners and UCX over TCP on ``lo``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import sys
import time
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from components.protocol.messages import GenerateRequest, RemotePrefillResult, SamplingParams
from components.protocol.metadata import RemotePrefillMode, WorkerRole
from components.runtime import eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.workers.config import vllm_engine, vllm_reference

VllmEngineConfig, _ENVIRONMENT, _TOPIC = vllm_reference()

logger = logging.getLogger(__name__)

MODES = ("pull", "recompute")


class KvTransferBenchConfig(BaseModel):
    """A decode engine's first token after a KV pull vs after recomputing the prompt, per prompt length."""

    model_path: str = Field(default="models/tiny-llama", description="Local model directory of both engines.")
    prompt_tokens: list[int] = Field(default=[512, 1536], description="Prompt lengths to measure (comma-separated).")
    rounds: int = Field(default=7, ge=1, description="Measured rounds; each takes one sample per mode and length.")
    kv_cache_memory_bytes: int = Field(default=64 * 2**20, ge=1, description="KV cache of each engine, in bytes.")
    max_model_len: int = Field(default=2048, ge=2, description="Most tokens of one sequence.")
    seed: int = Field(default=0, description="Seeds the prompts.")


def summary(values: list[float]) -> dict[str, float | int]:
    """Median, min, max and count of ``values`` (ms), rounded for reading."""
    if not values:
        return {"n": 0}
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "n": len(values),
    }


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """ABBA: pull first in even rounds, recompute first in odd ones."""
    return [MODES if r % 2 == 0 else (MODES[1], MODES[0]) for r in range(rounds)]


def ratios(pull_ms: list[float], recompute_ms: list[float]) -> list[float]:
    """Per round, recompute over pull (rounds where both modes have a sample)."""
    return [r / p for p, r in zip(pull_ms, recompute_ms, strict=False) if p > 0]


class Bench:
    def __init__(self, cfg: KvTransferBenchConfig) -> None:
        self.cfg = cfg
        ecfg = VllmEngineConfig(
            model_path=cfg.model_path,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            max_model_len=cfg.max_model_len,
            remote_prefill_mode="kv_transfer",
        )
        self.prefill = vllm_engine(ecfg, name="bench-prefill", role=WorkerRole.PREFILL)
        self.decode = vllm_engine(ecfg, name="bench-decode", role=WorkerRole.DECODE)
        self.rng = random.Random(cfg.seed)
        self.samples = 0
        self.pull_failures = 0

    def prompt(self, n: int) -> list[int]:
        vocab = self.decode.vocab_size or 256
        return [self.rng.randrange(vocab) for _ in range(n)]

    async def sample(self, mode: str, n: int) -> dict[str, float] | None:
        """One sample (module docstring); None when a pull sample's read failed (recomputed by vLLM)."""
        self.samples += 1
        rid = f"kvb-{self.samples}"
        req = GenerateRequest(rid, self.prompt(n), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        local = GenerateRequest(f"{rid}@prefill", req.token_ids, req.sampling)
        t0 = time.perf_counter()
        params: dict[str, Any] | None = None
        if mode == "pull":
            first, params = await self.prefill.prefill_handoff(local)
            if params is None:
                raise RuntimeError("the prefill engine kept no KV for a pull (is NIXL installed?)")
        else:
            first = None
            async with contextlib.aclosing(self.prefill.generate(local)) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids:
                        first = chunk
                        break
        assert first is not None
        prefill_ms = (time.perf_counter() - t0) * 1e3
        result = RemotePrefillResult(rid, 0, first.token_ids[:1], n, kv_transfer_params=params)
        stats = self.decode.stats
        before = (stats.num_kv_transfers, stats.kv_transfer_s, stats.num_kv_bytes_received)
        failures = stats.num_kv_transfer_failures

        async def delivered() -> RemotePrefillResult:
            return result

        own = 1 if mode == "pull" else 2  # the chunk that is the decode engine's own first token
        seen = 0
        t1 = time.perf_counter()
        first_own_ms = 0.0
        async with contextlib.aclosing(self.decode.generate_remote(req, delivered)) as chunks:
            async for _chunk in chunks:
                seen += 1
                if seen == own:
                    first_own_ms = (time.perf_counter() - t1) * 1e3
        out: dict[str, float] = {"first_token_ms": first_own_ms, "prefill_ms": prefill_ms}
        if mode == "pull":
            # The read's record reaches the stat logger with the step's stats, just after the tokens.
            deadline = time.monotonic() + 5
            while stats.num_kv_transfers == before[0] and stats.num_kv_transfer_failures == failures:
                if time.monotonic() > deadline:
                    raise RuntimeError("the decode engine recorded neither a KV read nor a failure")
                await asyncio.sleep(0.005)
            if stats.num_kv_transfer_failures != failures:
                self.pull_failures += 1
                return None
            out["kv_read_ms"] = (stats.kv_transfer_s - before[1]) * 1e3
            out["kv_bytes"] = stats.num_kv_bytes_received - before[2]
        return out

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        # Both at once: a start is mostly one core's imports in vLLM's new processes, so on 2 cores two starts take
        # little longer than one (measured: two `import vllm.v1.engine.core` at once 12.1 s each, one alone 10.6 s).
        # Every start is awaited before a failure is raised, so close() never meets an engine still starting.
        started = await asyncio.gather(self.prefill.start(), self.decode.start(), return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        # As a worker does once its engine runs: the ~600 k objects vLLM's import left stay out of the collector's
        # scans, in the samples below (no full collection walks them) and at exit (finalizing walked them for ~3 s).
        eventloop.freeze_startup_heap()
        if self.decode.remote_prefill_mode != RemotePrefillMode.KV_TRANSFER:
            raise RuntimeError(f"the decode engine cannot pull: {self.decode.remote_prefill_reason}")
        for n in cfg.prompt_tokens:
            if n + 2 > self.decode.max_model_len:
                raise ValueError(f"a {n}-token prompt does not fit max_model_len {self.decode.max_model_len}")
            for mode in MODES:  # warm-up: the first handshake, vLLM's first batches of each shape
                await self.sample(mode, n)
        results: dict[str, dict[str, list[dict[str, float] | None]]] = {
            str(n): {m: [] for m in MODES} for n in cfg.prompt_tokens
        }
        for r, order in enumerate(round_orders(cfg.rounds)):
            for n in cfg.prompt_tokens:
                for mode in order:
                    results[str(n)][mode].append(await self.sample(mode, n))
            logger.info("round %d/%d done", r + 1, cfg.rounds)
        lengths: dict[str, Any] = {}
        for length, by_mode in results.items():
            pulls = [s for s in by_mode["pull"] if s is not None]
            recs = [s for s in by_mode["recompute"] if s is not None]
            pull_ms = [s["first_token_ms"] for s in pulls]
            rec_ms = [s["first_token_ms"] for s in recs]
            paired = [
                (p["first_token_ms"], q["first_token_ms"])
                for p, q in zip(by_mode["pull"], by_mode["recompute"], strict=True)
                if p is not None and q is not None
            ]
            round_ratios = ratios([p for p, _ in paired], [q for _, q in paired])
            lengths[length] = {
                "pull_ms": summary(pull_ms),
                "recompute_ms": summary(rec_ms),
                "ratio_of_medians": round(statistics.median(rec_ms) / statistics.median(pull_ms), 2)
                if pull_ms and rec_ms
                else None,
                "median_round_ratio": round(statistics.median(round_ratios), 2) if round_ratios else None,
                "kv_read_ms": summary([s["kv_read_ms"] for s in pulls]),
                "kv_bytes": int(statistics.median([s["kv_bytes"] for s in pulls])) if pulls else 0,
                "prefill_ms": {
                    "pull": summary([s["prefill_ms"] for s in pulls]),
                    "recompute": summary([s["prefill_ms"] for s in recs]),
                },
                "samples": {
                    m: [None if s is None else round(s["first_token_ms"], 2) for s in by_mode[m]] for m in MODES
                },
            }
        return {
            "bench": "kv-transfer",
            "config": cfg.model_dump(),
            "block_size": self.decode.block_size,
            "rounds": cfg.rounds,
            "order": "ABBA (pull first in even rounds)",
            "pull_failures": self.pull_failures,
            "lengths": lengths,
        }

    async def close(self) -> None:
        await asyncio.gather(self.prefill.shutdown(), self.decode.shutdown(), return_exceptions=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, KvTransferBenchConfig)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = model_from_args(KvTransferBenchConfig, args)
    except ValidationError as e:
        raise SystemExit(f"kvmesh bench kv-transfer: {e}") from None
    return asyncio.run(_main(cfg))


async def _main(cfg: KvTransferBenchConfig) -> int:
    bench = Bench(cfg)
    try:
        result = await bench.run()
    except Exception as e:  # noqa: BLE001 - also the engine's EngineDeadError (no NIXL, no weights): said, exit 1
        print(f"kvmesh bench kv-transfer: {e}", file=sys.stderr)
        return 1
    finally:
        await bench.close()
    for n, r in result["lengths"].items():
        print(
            f"{n:>6} tokens: decode's first token after a pull {r['pull_ms'].get('median')} ms, after recompute "
            f"{r['recompute_ms'].get('median')} ms (x{r['ratio_of_medians']}; rounds' median "
            f"x{r['median_round_ratio']}), KV read {r['kv_read_ms'].get('median')} ms for {r['kv_bytes']} bytes",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0
