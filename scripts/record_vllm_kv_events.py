"""Record the raw KV-event messages vLLM publishes for a small scripted workload, for the adapter's unit tests.

Writes tests/unit/workers/data/vllm_kv_events.json: the prompts, vLLM's version, and every message of the publisher as
``[seq, payload hex]`` in order. ``tests/unit/workers/test_vllm_adapter.py`` replays them through the adapter's
decoder and translator without vLLM. Workload (block size 32, KV cache of 2 MiB = 31 usable blocks of this model):

1. prompt A, 100 tokens: vLLM stores A's 3 full blocks (parent None);
2. prompt B = A[:64] + 36 other tokens: vLLM reuses 2 blocks and stores 1 (parent = A's second block);
3. prompts C0..C3, 300 tokens each: 9 blocks stored per prompt, so the cache (31 blocks) must evict, A's and B's
   blocks included (BlockRemoved);
4. reset_prefix_cache, then prompt A again: AllBlocksCleared (published with that next step), then A's 3 blocks.

Run with the vLLM venv after scripts/make_tiny_weights.py (about 20 s)::

    .venv/bin/python scripts/record_vllm_kv_events.py
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
OUT = REPO_ROOT / "tests" / "unit" / "workers" / "data" / "vllm_kv_events.json"


async def record() -> dict:
    import vllm

    from components.protocol.messages import GenerateRequest, SamplingParams
    from components.workers.engines.vllm import VllmEngine, VllmEngineConfig

    prompt_a = list(range(10, 110))
    prompt_b = prompt_a[:64] + [(3 * i + 1) % 256 for i in range(36)]
    prompts_c = [[(11 * i + 7 * j + 5) % 256 for j in range(300)] for i in range(4)]
    cfg = VllmEngineConfig(
        model_path=str(REPO_ROOT / "models" / "tiny-llama"), kv_cache_memory_bytes=2 * 2**20, max_model_len=512
    )
    engine = VllmEngine(cfg, name="record")
    messages: list[list] = []
    await engine.start()
    # Tap the subscriber: keep every raw message, then let the adapter handle it as usual.
    handle = engine._on_kv_batch  # private on purpose: a recording tool, not production code

    def tap(seq: int, payload: bytes) -> None:
        messages.append([seq, payload.hex()])
        handle(seq, payload)

    engine.subscriber._on_batch = tap
    try:

        async def run(rid: str, prompt: list[int]) -> None:
            req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            async for _ in engine.generate(req):
                pass
            await asyncio.sleep(0.2)  # events are published per step, independently of the token stream

        await run("a", prompt_a)
        await run("b", prompt_b)
        for i, p in enumerate(prompts_c):
            await run(f"c{i}", p)
        assert await engine.reset_prefix_cache()
        await run("a-again", prompt_a)
    finally:
        await engine.shutdown()
    return {
        "vllm_version": vllm.__version__,
        "block_size": engine.block_size,
        "prompts": {"a": prompt_a, "b": prompt_b, **{f"c{i}": p for i, p in enumerate(prompts_c)}},
        "messages": messages,
    }


def main() -> int:
    data = asyncio.run(record())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(data['messages'])} messages to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
