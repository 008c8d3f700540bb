"""``kvmesh profile``: measure one engine's performance profile and write it as JSON and a PNG.

    kvmesh profile --engine mock --out mock-profile.json
    kvmesh profile --engine vllm --model-path models/tiny-llama --out tiny-profile.json

A thin command: the grid and the engine come from the flags, ``components.workers.profiling`` measures,
``components.perf.profile.Profile`` holds the result. A worker started with ``kvmesh worker --profile FILE``
announces the profile's fitted step-time coefficients and its id in its registration (README: kvmesh profile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from components.perf.profile import Profile
from components.runtime import eventloop
from components.workers.config import EngineKind, build_engine, engine_config_model
from components.workers.profiling import ProfileGrid, profile_engine

DEFAULT = ProfileGrid()
# The tiny model's context is 2048 tokens (models/tiny-llama/config.json): its grid stays inside it.
VLLM_GRID = ProfileGrid(prompt_tokens=(64, 256, 512, 1024), batch_sizes=(1, 4, 8), context_tokens=(128, 512))


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["mock", "vllm"], default="mock", help="engine to measure (default: mock)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--png", default=None, help="where to draw it (default: --out with .png; '' for none)")
    p.add_argument(
        "--prompt-tokens",
        type=_ints,
        default=None,
        help=f"prefill grid: prompt lengths in tokens, comma-separated, each at most the token budget (default: "
        f"mock {','.join(map(str, DEFAULT.prompt_tokens))}; vllm {','.join(map(str, VLLM_GRID.prompt_tokens))})",
    )
    p.add_argument(
        "--batch-sizes",
        type=_ints,
        default=None,
        help=f"decode grid: sequences in the batch (default: mock {','.join(map(str, DEFAULT.batch_sizes))}; "
        f"vllm {','.join(map(str, VLLM_GRID.batch_sizes))})",
    )
    p.add_argument(
        "--context-tokens",
        type=_ints,
        default=None,
        help=f"decode grid: prompt tokens of each sequence (default: mock "
        f"{','.join(map(str, DEFAULT.context_tokens))}; vllm {','.join(map(str, VLLM_GRID.context_tokens))})",
    )
    p.add_argument("--repeats", type=int, default=DEFAULT.repeats, help="timed runs per grid point")
    p.add_argument(
        "--warmup", type=int, default=DEFAULT.warmup, help="untimed runs per prefill point and before decode"
    )
    p.add_argument(
        "--warmup-steps", type=int, default=DEFAULT.warmup_steps, help="decode steps skipped at the start of each run"
    )
    p.add_argument("--decode-steps", type=int, default=DEFAULT.decode_steps, help="decode steps timed in each run")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's token budget per step, tokens (default: mock 8192, the mock engine's; vllm 2048, the "
        "tiny model's context)",
    )
    p.add_argument(
        "--speedup-ratio",
        type=float,
        default=1.0,
        help="mock only: the simulated engine runs this many times faster than the model it simulates, and the "
        "measured wall times are multiplied back by it. Each step's wall time also carries the event loop's "
        "overshoot (0.1-2 ms: epoll waits in whole ms), which is multiplied too: at 1 (default) a 5 ms decode step "
        "reads ~5.4-7 ms; 4 makes the run ~4x shorter and the decode steps read up to ~8 ms more",
    )
    p.add_argument("--model-path", default="models/tiny-llama", help="vllm only: local model directory")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts")


def _grid(args: argparse.Namespace) -> ProfileGrid:
    base = VLLM_GRID if args.engine == "vllm" else DEFAULT
    try:
        return ProfileGrid(
            prompt_tokens=args.prompt_tokens or base.prompt_tokens,
            batch_sizes=args.batch_sizes or base.batch_sizes,
            context_tokens=args.context_tokens or base.context_tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            warmup_steps=args.warmup_steps,
            decode_steps=args.decode_steps,
        )
    except ValueError as e:
        raise SystemExit(f"kvmesh profile: {e}") from None


def _engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The engine to measure and what to pass ``profile_engine`` about it."""
    if args.engine == "mock":
        from components.workers.simulated import MockEngineConfig

        budget = args.max_num_batched_tokens or MockEngineConfig().max_num_batched_tokens
        cfg = MockEngineConfig(speedup_ratio=args.speedup_ratio, max_num_batched_tokens=budget)
        return build_engine(EngineKind.MOCK, cfg, "profile-mock"), {
            "max_num_batched_tokens": budget,
            "vocab_size": cfg.vocab_size,
            "time_scale": args.speedup_ratio,
            "host_load_ms_per_token": cfg.host_load_ms_per_token,
            "meta": {"engine": "mock", "configured": cfg.step_time_model.to_mapping()},
        }
    path = Path(args.model_path).expanduser().resolve()
    try:
        model_cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except OSError as e:
        raise SystemExit(f"kvmesh profile: {path} is not a model directory ({e})") from None
    budget = args.max_num_batched_tokens or 2048
    vcfg = engine_config_model(EngineKind.VLLM)(model_path=str(path), max_num_batched_tokens=budget)
    return build_engine(EngineKind.VLLM, vcfg, "profile-vllm"), {
        "max_num_batched_tokens": budget,
        "vocab_size": int(model_cfg["vocab_size"]),
        "time_scale": 1.0,
        "meta": {"engine": "vllm", "model_path": str(path)},
    }


async def run_profile(args: argparse.Namespace) -> Profile:
    grid = _grid(args)
    engine, kwargs = _engine(args)
    await engine.start()
    # As a worker does once its engine runs (the profile models a worker's engine): what start-up allocated (vLLM's
    # import: ~600 k objects) stays out of the collector's scans while measuring and at exit (~3 s of finalizing).
    eventloop.freeze_startup_heap()
    try:
        return await profile_engine(
            engine, grid, seed=args.seed, progress=lambda s: print(s, file=sys.stderr, flush=True), **kwargs
        )
    finally:
        await engine.shutdown()


def draw(profile: Profile, path: str) -> None:
    """Prefill medians (bars: least to most of the repeats) with the fitted model; decode medians per batch size
    against context, with the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = profile.prompt_tokens
    med = [p.median_ms for p in profile.prefill]
    a.errorbar(
        xs,
        med,
        yerr=[[p.median_ms - p.min_ms for p in profile.prefill], [p.max_ms - p.median_ms for p in profile.prefill]],
        fmt="o",
        label="measured (median, min-max)",
    )
    fine = [round(xs[0] + (xs[-1] - xs[0]) * i / 100) for i in range(101)]
    a.plot(fine, [profile.fit.prefill_ms(n) for n in fine], "-", label="fitted model")
    a.set_xlabel("prompt tokens")
    a.set_ylabel("prefill step, ms")
    a.set_title(f"prefill (fit: rel. err. max {profile.fit_error['prefill_rel_max']:.1%})")
    a.legend()
    cs = profile.context_tokens
    for i, bs in enumerate(profile.batch_sizes):
        row = profile.decode[i]
        line = b.errorbar(
            cs,
            [p.median_ms for p in row],
            yerr=[[p.median_ms - p.min_ms for p in row], [p.max_ms - p.median_ms for p in row]],
            fmt="o",
            label=f"batch {bs}",
        )
        b.plot(cs, [profile.fit.decode_ms(bs, bs * c) for c in cs], "--", color=line[0].get_color())
    b.set_xlabel("context tokens per sequence")
    b.set_ylabel("decode step, ms")
    b.set_title(f"decode (dashed: fit, rel. err. max {profile.fit_error['decode_rel_max']:.1%})")
    b.legend()
    fig.suptitle(f"{profile.meta.get('engine', 'engine')} profile {profile.profile_id}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    profile = asyncio.run(run_profile(args))
    profile.save(args.out)
    png = str(Path(args.out).with_suffix(".png")) if args.png is None else args.png
    if png:
        draw(profile, png)
    summary = {
        "profile": args.out,
        "png": png or None,
        "profile_id": profile.profile_id,
        "fit": profile.fit.to_mapping(),
        "fit_error": profile.fit_error,
    }
    print(json.dumps(summary))
    return 0
