"""How long a hot-prefix copy between two vLLM engines takes (docs/rescheduler.md, "Hot-prefix replication"), against
the destination computing the same prefix itself, in alternating ABBA rounds on the same two engines.

Two in-process ``VllmEngine``s (models/tiny-llama, the NIXL connector in kv_both, 64 KV blocks of 32 tokens each, as
tests/integration/test_vllm_migration.py starts them). Each round takes a fresh prefix of ``--blocks`` blocks
(random token ids: no cache holds any of it), computes it on engine a (not timed), then either

* **copy**: ``a.export_prefix`` (a computes the prefix's last block again and keeps the blocks for a pull) and
  ``b.pull_prefix`` (b pulls them over NIXL and computes one token): what a vLLM worker's ``import_prefix`` runs, less
  the two request-plane hops; or
* **compute**: b prefills the same number of fresh tokens itself (``max_tokens=1``): what a copy saves the first
  request that carries the prefix to b.

Prints one line per round and the medians. Run from the repository root with the vLLM venv::

    PYTHONPATH=. .venv/bin/python scripts/vllm_prefix_copy.py --blocks 30 --rounds 4

The ``if __name__ == "__main__"`` guard is required: vLLM's CPU platform spawns its engine-core process, which
re-imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import GenerateRequest, SamplingParams
from components.workers.engines.vllm import VllmEngine, VllmEngineConfig

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-llama"
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens


async def run_once(engine: VllmEngine, rid: str, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    request = GenerateRequest(rid, tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    async for _ in engine.generate(request):
        pass
    return time.perf_counter() - t0


async def until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)


async def main(blocks: int, rounds: int) -> None:
    config = VllmEngineConfig(model_path=str(MODEL_DIR), kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=1024)
    a, b = VllmEngine(config, name="a"), VllmEngine(config, name="b")
    await asyncio.gather(a.start(), b.start())
    try:
        assert a.prefix_copy_refusal() is None, a.prefix_copy_refusal()
        bs = a.block_size
        rng = random.Random(blocks)
        times: dict[str, list[float]] = {"copy": [], "compute": []}
        order = ["copy", "compute", "compute", "copy"] * rounds  # ABBA
        for i, side in enumerate(order):
            prefix = [rng.randrange(1, 300) for _ in range(blocks * bs)]
            hashes = block_hashes(prefix, bs)
            if side == "compute":
                elapsed = await run_once(b, f"compute-{i}", prefix)
            else:
                await run_once(a, f"warm-{i}", [*prefix, 1])
                await until(lambda: all(a.translator.holds(x) for x in hashes))  # noqa: B023 - awaited here
                t0 = time.perf_counter()
                held, tokens, handoff, error = await a.export_prefix(hashes)
                assert not error and handoff is not None and held == blocks, error
                imported, error = await b.pull_prefix(tokens, handoff)
                elapsed = time.perf_counter() - t0
                assert not error and imported == blocks, (imported, error)
            times[side].append(elapsed)
            print(f"round {i}: {side} of {blocks} blocks ({blocks * bs} tokens): {elapsed * 1e3:.1f} ms", flush=True)
        for side, values in times.items():
            print(f"{side}: median {statistics.median(values) * 1e3:.1f} ms over {len(values)} rounds", flush=True)
        print(f"loadavg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=30, help="prefix length in KV blocks (32 tokens each)")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (each: copy, compute, compute, copy)")
    args = parser.parse_args()
    asyncio.run(main(args.blocks, args.rounds))
