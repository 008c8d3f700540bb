"""The pure parts of ``kvmesh bench rescheduling-live``: when the fleet counts as joined and as converged, and what
counts as a stream lost, short or altered; the simulated side's scale-up on the live trigger."""

from __future__ import annotations

import argparse

import pytest

from components.cli.bench.rescheduling_live import add_arguments, convergence, integrity, simulate_same_start


def test_convergence_counts_from_the_sample_that_has_every_worker_to_the_first_with_no_source():
    # Threshold 0.25, interval 0.5 s. The full fleet (2 workers) is first seen at t = 1.0; the first sample from then
    # on with both below 0.25 is t = 2.2: 1.2 s = 2.4 intervals, so 3 cycles. After it, t = 2.7 has 0.26 again (a
    # source until the next sample, 3.0): 0.3 s as a source again.
    samples = [
        {"t": 0.5, "use": {"a": 0.4}},
        {"t": 1.0, "use": {"a": 0.41, "b": 0.0}},
        {"t": 1.6, "use": {"a": 0.3, "b": 0.1}},
        {"t": 2.2, "use": {"a": 0.2, "b": 0.2}},
        {"t": 2.7, "use": {"a": 0.26, "b": 0.2}},
        {"t": 3.0, "use": {"a": 0.2, "b": 0.2}},
    ]
    c = convergence(samples, 2, 0.25, 0.5)
    assert c["joined_s"] == 1.0 and c["max_use_at_join"] == 0.41
    assert c["converged_s"] == 2.2 and c["seconds"] == pytest.approx(1.2) and c["cycles"] == 3
    assert c["source_again_s"] == pytest.approx(0.3)


def test_a_fleet_that_never_joins_or_never_converges_says_so():
    samples = [{"t": 0.0, "use": {"a": 0.5}}, {"t": 1.0, "use": {"a": 0.5, "b": 0.3}}]
    assert convergence(samples, 3, 0.25, 0.5)["joined_s"] is None
    c = convergence(samples, 2, 0.25, 0.5)
    # 0.3 is at or above 0.25: still a source, never converged.
    assert c["joined_s"] == 1.0 and c["converged_s"] is None and c["cycles"] is None


def test_integrity_names_failed_short_and_altered_streams():
    expected = {0: "abc", 1: "def", 2: "ghi", 3: "jkl"}
    results = [
        {"index": 0, "error": None, "tokens": 5, "text": "abc"},  # intact
        {"index": 1, "error": "HTTP 503: no worker", "tokens": None, "text": ""},
        {"index": 2, "error": None, "tokens": 4, "text": "ghi"},  # one token short
        {"index": 3, "error": None, "tokens": 5, "text": "jkk"},  # a token repeated or lost changes the text
    ]
    r = integrity(results, expected, 5)
    assert r["requests"] == 4 and r["completed"] == 2 and r["failed"] == 1
    assert r["failures"] == ["HTTP 503: no worker"]
    assert r["wrong_token_count"] == [(2, 4)] and r["text_differs_from_unmoved"] == [3]
    assert r["intact"] is False
    assert integrity(results[:1], expected, 5)["intact"] is True


def test_the_default_start_is_imbalanced_movable_and_ends_well_below_the_threshold():
    """The shipped graph with the command's defaults: the settings the docs' figures rest on."""
    import argparse
    from pathlib import Path

    from components.cli.bench.rescheduling_live import add_arguments, overrides
    from components.deploy.graph import load_graph

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    root = Path(__file__).resolve().parents[3]
    g = load_graph(root / a.graph, overrides(a)[1::2])
    assert g.rescheduler is not None and [str(x) for x in g.rescheduler.rescheduling_policies] == ["neutral_load"]
    assert g.rescheduler.rescheduling_neutral_load_threshold == a.threshold == 0.25
    assert g.workers[0].replicas == 1 and g.workers[0].num_gpu_blocks == a.num_gpu_blocks == 2048
    capacity = a.num_gpu_blocks * 16  # tokens of one worker's KV
    per_request_end = a.prompt_tokens + a.max_tokens  # 1256
    # One worker holds all 16 to their end without preempting: 16 x 1256 / 32768 = 0.61.
    assert a.requests * per_request_end / capacity == pytest.approx(0.613, abs=1e-3)
    # Spread over 1 + 3 workers they end at 0.15, well below 0.25.
    assert a.requests * per_request_end / ((1 + a.add_workers) * capacity) == pytest.approx(0.153, abs=1e-3)
    # At --add-at each request holds 0.3 x 32768 / 16 = 614 tokens: under the default selection's 1024-token budget
    # (rescheduling_req_select_value), so the first pairs find requests to move.
    assert a.add_at * capacity / a.requests == pytest.approx(614.4)
    assert a.add_at * capacity / a.requests < g.rescheduler.rescheduling_req_select_value == 1024


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_simulated_scale_up_follows_the_fleet_not_a_late_live_clock():
    # On a busy machine the live start is late; a scale-up at the live add_s second found the simulated streams
    # already finished (a CI run: converged with 0 migrations). Pure simulation, no process started.
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
