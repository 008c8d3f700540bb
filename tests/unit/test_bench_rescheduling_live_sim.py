"""The simulated side of ``kvmesh bench rescheduling-live`` asks for its scale-up on the live side's trigger (a
worker's projected KV use reaching ``--add-at``), not at the live clock's ``add_s``: on a busy machine the live start
is late, and a scale-up at the live second found the simulated streams already finished (CI: converged with 0
migrations). Pure simulation, no process started."""

from __future__ import annotations

import argparse

from components.cli.bench.rescheduling_live import add_arguments, simulate_same_start


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_simulated_scale_up_follows_the_fleet_not_a_late_live_clock():
    args = _args("--max-tokens", "600", "--speedup-ratio", "0.5")
    # A live side 30 s late: its add_s lies long after the simulated streams (~7 s of 600 tokens) would have ended.
    sim = simulate_same_start(args, live_add_s=30.0, live_joined_s=31.5, live_ended_s=40.0)
    assert sim["add_s"] is not None and sim["add_s"] < 10.0, sim["add_s"]
    assert sim["startup_s"] == 1.5
    assert sim["migrations"] >= 1
    assert sim["output_tokens_by_request"] == [600] * 16
    # It asked once the one worker reached --add-at, as the live side does.
    before = [max(s["use"].values()) for s in sim["samples"] if s["use"] and s["t"] <= sim["add_s"]]
    assert max(before) >= args.add_at
