"""``profile_engine`` on the simulated engine: the profile it measures recovers the engine's configured step-time
model exactly.

On virtual time (tests/support/virtual_time.py): ``MockEngine`` ends each step with a sleep of its modelled time, and
both the engine and the profiler read the virtual loop's clock, so a step measures exactly its modelled time, with no
event-loop overshoot and on any machine however loaded (the same run on the wall clock measured steps 0.4-1.8 ms late
on the shared 2-core VM, which a timed test would have to tolerate). That makes the profiler's own bookkeeping
checkable to rounding: which token's intervals it times, the context each timed step attends to, the scale-back.
The real-time path (wall clock, ``kvmesh profile``) is exercised by tests/integration/test_profile_cli.py.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from components.perf.profile import Profile
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.profiling import ProfileGrid, profile_engine
from tests.support.virtual_time import run_virtual

pytestmark = pytest.mark.unit

CONFIG = MockEngineConfig(
    speedup_ratio=1.0,
    prefill_base_ms=30.0,
    prefill_ms_per_token=0.02,
    prefill_ms_per_token_sq=0.0,
    decode_base_ms=30.0,
    decode_ms_per_seq=0.5,
    decode_ms_per_kv_token=2e-3,
    vocab_size=1000,
    eos_token_id=None,
    num_gpu_blocks=2048,
    max_model_len=4096,
)
GRID = ProfileGrid(
    prompt_tokens=(256, 1024, 2048), batch_sizes=(1, 4), context_tokens=(256, 1024), repeats=2, decode_steps=6
)


async def _profile(config: MockEngineConfig, grid: ProfileGrid, time_scale: float = 1.0) -> Profile:
    clock = asyncio.get_running_loop().time
    engine = MockEngine(config, name="profiled", clock=clock)
    await engine.start()
    try:
        return await profile_engine(
            engine,
            grid,
            max_num_batched_tokens=config.max_num_batched_tokens,
            vocab_size=config.vocab_size,
            time_scale=time_scale,
            clock=clock,
        )
    finally:
        await engine.shutdown()


def test_profiling_the_simulated_engine_recovers_its_configured_model():
    profile, _ = run_virtual(_profile(CONFIG, GRID))
    true = CONFIG.step_time_model
    # Each median is the modelled time of one step: a prefill of n tokens alone; a decode of b sequences over b x c
    # KV tokens, c being the mean context of the timed steps: prompt + warm-up steps + (timed steps + 1) / 2.
    for n, p in zip(GRID.prompt_tokens, profile.prefill, strict=True):
        assert p.median_ms == pytest.approx(true.prefill_ms(n), rel=1e-9), n
        assert p.min_ms == pytest.approx(p.max_ms, rel=1e-9)  # repeats agree: nothing but the model takes time
    for (i, b), (j, c) in itertools.product(enumerate(GRID.batch_sizes), enumerate(profile.context_tokens)):
        assert c == GRID.context_tokens[j] + GRID.warmup_steps + (GRID.decode_steps + 1) / 2
        assert profile.decode[i][j].median_ms == pytest.approx(true.decode_ms(b, b * c), rel=1e-9), (b, c)
    # The model is linear in what the grid varies (prefill_ms_per_token_sq is 0 here), so the fit is exact.
    for name in ("prefill_base_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq"):
        assert getattr(profile.fit, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert profile.fit.decode_ms_per_kv_token == pytest.approx(true.decode_ms_per_kv_token, rel=1e-6)
    assert profile.fit_error["prefill_rel_max"] < 1e-9 and profile.fit_error["decode_rel_max"] < 1e-9
    assert Profile.from_json(profile.to_json()) == profile


def test_a_faster_engine_is_scaled_back_to_the_model_it_simulates():
    # speedup 4: each step sleeps a quarter of its modelled time; time_scale 4 multiplies it back.
    fast = CONFIG.model_copy(update={"speedup_ratio": 4.0})
    profile, elapsed = run_virtual(_profile(fast, GRID, time_scale=4.0))
    slow, elapsed_slow = run_virtual(_profile(CONFIG, GRID))
    assert elapsed == pytest.approx(elapsed_slow / 4, rel=1e-9)
    for p, q in zip(profile.prefill, slow.prefill, strict=True):
        assert p.median_ms == pytest.approx(q.median_ms, rel=1e-9)
    for row, row_slow in zip(profile.decode, slow.decode, strict=True):
        for p, q in zip(row, row_slow, strict=True):
            assert p.median_ms == pytest.approx(q.median_ms, rel=1e-9)


def test_a_grid_point_longer_than_one_step_is_refused():
    with pytest.raises(ValueError, match="token budget"):
        import asyncio

        asyncio.run(
            profile_engine(
                MockEngine(CONFIG, name="x"),
                ProfileGrid(prompt_tokens=(9000,)),
                max_num_batched_tokens=8192,
                vocab_size=10,
            )
        )
