"""The SLA planner (``planner: {mode: sla}``) on a served graph of simulated workers: real etcd, nats-server, circus,
frontend (whose request reports the planner reads), workers and the ``local`` connector (issue 25).

A burst grows the aggregated pool before any request's time to first token breaks the target; a quiet trickle
afterwards shrinks it back to one worker with no failed request and no stream ended short; ``kvmesh status``,
``/metrics`` and TensorBoard say what the SLA planner saw (its mode, request rate, targets and pool sizes).

The workers' step-time model is set slow (a 30 ms decode step plus 4 ms per sequence; 0.5 ms per prompt token) so
that a load two cores can send needs a second worker: with the ITL target at 60 ms a worker decodes at most 7
sequences (30 + 4 x 7 = 58 ms), ~120 output tokens/s; ten streams of 100 tokens at a time need about 140 tokens/s,
and their batch of ten steps in ~70 ms, over the target (the fast loop). A trickle of one 16-token stream needs
~30 tokens/s, and one worker carrying both workers' load stays under 0.8 x 60 ms (the consolidation check).

The race the burst runs (what the planner sees, from its logs and TensorBoard pulls on a loaded machine): the first
of the burst's prompts to reach the worker start a prefill step of the k that arrived (150 ms each); the others wait.
That step's prompts get their first tokens at its end, 10 + 150 k ms on, over the target for k >= 4. The planner sees
it coming from the step's start: k <= 7, by the waiting prompts (3 or more: a new prompt's predicted TTFT >= 610 ms,
the fast loop's TTFT rule); k >= 8, by the batch (ITL 62-70 ms: at once for 9 or 10, two pulls running for 8). Under
CPU load the burst straggles (k from 1 to 10 in 30 runs here). Before the fix the TTFT rule waited for a request
to finish (an output length) and a throughput decision at the same pull dropped the fast loop's raise, so with k = 6
or 7 the raise came from the ITL rule at the second step's start, the moment the first step's tokens went out: 5
runs of 17 failed (e.g. decided 1.18 s into the burst, 0.19 s after the first breach; docs/sla-planner.md).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.test_planner_local import (
    MODEL,
    PLANNER_NS,
    Streams,
    decision_texts,
    log_time,
    long_prompt,
    metric,
    planner_log,
    read_scalars,
    sets,
)
from tests.e2e.test_serve import ROOT, http_get, run_kvmesh, serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TTFT_MS = 600.0
ITL_MS = 60.0


def up_decisions(serve) -> list[float]:
    """Wall times of the planner's adjustments that scaled the decode pool up (its log)."""
    return [log_time(x) for x in planner_log(serve).splitlines() if "planner adjustment" in x and "scale up" in x]


async def test_the_sla_planner_grows_the_pool_ahead_of_a_burst_and_shrinks_it_in_quiet_losing_nothing(tmp_path):
    tb = tmp_path / "tb"
    args = sets(
        "frontend.port=0",
        "frontend.router_policy=least_loaded",
        "workers[0].decode_base_ms=30",
        "workers[0].decode_ms_per_seq=4",
        "workers[0].prefill_base_ms=10",
        "workers[0].prefill_ms_per_token=0.5",
        "planner.mode=sla",
        f"planner.ttft={TTFT_MS}",
        f"planner.itl={ITL_MS}",
        "planner.load_predictor=constant",
        "planner.adjustment_interval=3",
        # Pulls and the frontend's request reports every 0.25 s (defaults 0.5 and 1 s): the burst's prompts break the
        # TTFT target from ~0.85 s after they are sent, and with 0.5 s pulls and 1 s reports the decision came
        # 0.8-1 s in on a loaded CI machine (twice 0.04-0.74 s after the first breach): sooner looks give the planner
        # the margin to be ahead; the claim is the same.
        "planner.metric_pulling_interval=0.25",
        "frontend.request_stats_interval_s=0.25",
        "planner.max_gpu_budget=3",
        f"planner.log_dir={tb}",
    )
    new = f"{PLANNER_NS}-mock-1"
    with serving(tmp_path / "state", *args, graph=ROOT / "graphs" / "mock_planner.yaml") as serve:
        url = serve.wait_ready()
        st0 = serve.state(PLANNER_NS)
        [worker] = [w for w in st0.watchers if w.kind == "worker"]
        assert worker.startup_s is not None and worker.startup_s > 0  # serve measured it: the planner's lead
        # The planner discovers the model on its own after serve is ready: a burst sent before it pulls at all is
        # raced, not planned for (here its READY came 0.6 s into such a burst; in a CI run its first decision came
        # 0.74 s after the first TTFT breach). Its READY line is the event to wait for.
        deadline = time.monotonic() + 60
        while "READY planner" not in planner_log(serve):
            assert time.monotonic() < deadline, f"the planner never became ready:\n{planner_log(serve)}"
            await asyncio.sleep(0.05)
        streams = Streams(url)

        def grown() -> bool:
            w = serve.state(PLANNER_NS).watcher(new)
            return w is not None and bool(w.processes)

        # Burst: ten streams of ~300-token prompts and 100 output tokens until a second worker runs.
        await streams.run(10, long_prompt, 100, grown, max_requests=200, max_s=90)
        assert grown(), f"the pool did not grow; planner log:\n{planner_log(serve)}"
        ups = up_decisions(serve)
        assert ups, planner_log(serve)
        # Ahead of the latency: the first scale-up came no later than the first request whose TTFT (at the
        # client) broke the target. Some request does break it (the claim is not vacuous): the burst's ten prompts
        # queue 1.5 s of prefill on the one worker, which no new worker takes from it (every run here: all ten).
        broke = [o.first for o in streams.outcomes if o.first is not None and o.first - o.sent > TTFT_MS / 1e3]
        assert broke, [(o.sent, o.first) for o in streams.outcomes]
        assert ups[0] <= min(broke) + 0.001, (ups[0], min(broke), planner_log(serve))

        def shrunk() -> bool:
            workers = [w.name for w in serve.state(PLANNER_NS).watchers if w.kind == "worker"]
            return workers == [f"{PLANNER_NS}-mock-0"]

        # Quiet: one short stream at a time until the pool is back at one worker.
        await streams.run(1, lambda i: f"short {i}", 16, shrunk, max_requests=600, max_s=120)
        assert shrunk(), f"the pool did not shrink; planner log:\n{planner_log(serve)}"
        failures = [o for o in streams.outcomes if not o.complete]
        # Every stream complete: the burst's (ten lanes, at least one each) and the quiet ones sent until the pool
        # was back at one worker, through the scale-down.
        burst = [o for o in streams.outcomes if o.max_tokens == 100]
        quiet = [o for o in streams.outcomes if o.max_tokens == 16]
        assert failures == [] and len(burst) >= 10 and len(quiet) >= 1, failures[:3]

        # What it says: kvmesh status (mode and numbers), /metrics.
        # The planner's line is its published status: no load window needed.
        table = run_kvmesh(
            "status", "--state-dir", str(serve.state_dir), "--namespace", PLANNER_NS, "--load-wait-s", "0"
        ).stdout
        line = next(x for x in table.splitlines() if x.startswith(f"{PLANNER_NS}: planner {MODEL} (sla mode"))
        assert "req/s" in line and "TTFT" in line, line
        url_m = line.split("metrics ", 1)[1].split(")", 1)[0]
        _, body = http_get(url_m)
        text = body.decode()
        assert (metric(text, "kvmesh_planner_changes_total", direction="up", outcome="done") or 0) >= 1
        assert (metric(text, "kvmesh_planner_changes_total", direction="down", outcome="done") or 0) >= 1
        assert metric(text, "kvmesh_planner_changes_total", outcome="failed") is None
        assert metric(text, "kvmesh_planner_sla_observed_request_rate") is not None

    acc = read_scalars(tb)
    tags = set(acc.Tags()["scalars"])
    assert {"sla/observed_request_rate", "sla/predicted_request_rate", "sla/decode", "sla/target_decode"} <= tags
    rates = [e.value for e in acc.Scalars("sla/observed_request_rate")]
    assert max(rates) > 0.5  # the burst was heard through the frontend's request reports
    texts = decision_texts(acc)
    assert any("scale up" in t for t in texts) and any("scale down" in t for t in texts)


async def test_the_local_connector_starts_several_workers_of_one_step_together(tmp_path, caplog):
    """A step of several workers (the SLA planner asks for them at once) takes one start-up, not one per worker:
    every new watcher is added before the first of them is up."""
    import logging

    from components.planner.connectors.local import LocalConnector
    from components.planner.policy import Pool
    from components.runtime import Runtime, RuntimeConfig

    with serving(tmp_path / "state", *sets("frontend.port=0"), graph=ROOT / "graphs" / "mock_planner.yaml") as serve:
        serve.wait_ready()
        st = serve.state(PLANNER_NS)
        rt = await Runtime.connect(RuntimeConfig(etcd_endpoints=st.etcd_endpoints, nats_url=st.nats_url))
        try:
            c = LocalConnector(rt, PLANNER_NS, MODEL, serve.state_dir)
            with caplog.at_level(logging.INFO, logger="components.planner.connectors.local"):
                await c.set_pool_size(Pool.DECODE, 3)
            # The two new watchers are added concurrently: the state file lists them in either order.
            names = sorted(w.name for w in serve.state(PLANNER_NS).watchers if w.kind == "worker")
            assert names == [f"{PLANNER_NS}-mock-{i}" for i in range(3)] and c.num_added == 2, names
            lines = [r.getMessage() for r in caplog.records]
            added = [i for i, m in enumerate(lines) if "added watcher" in m]
            up = [i for i, m in enumerate(lines) if m.endswith(" is up")]
            assert len(added) == 2 and len(up) == 2 and max(added) < min(up), lines
            await c.set_pool_size(Pool.DECODE, 1)
            assert [w.name for w in serve.state(PLANNER_NS).watchers if w.kind == "worker"] == [names[0]]
        finally:
            await rt.shutdown(drain_timeout_s=1.0)
