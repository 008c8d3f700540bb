"""``kvmesh profile`` and ``kvmesh worker --profile``: a profile is measured and written, and a worker started with
it registers the profile's fitted coefficients and id (real etcd and nats-server)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.perf.model import StepTimeModel
from components.perf.profile import Profile
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.metadata import WorkerMetadata
from components.workers.simulated import MockEngineConfig
from tests.integration.test_worker import ROOT, ready_instance_id, worker_command, worker_env

pytestmark = pytest.mark.integration


def run_profile(out: Path, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "components.cli.main", "profile", "--out", str(out), *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kvmesh_profile_writes_the_profile_and_its_png(tmp_path):
    out = tmp_path / "mock.json"
    # A tiny grid of the simulated engine at 4x speed: ~2 s.
    summary = run_profile(
        out, "--prompt-tokens", "256,1024", "--batch-sizes", "1,4", "--context-tokens", "256", "--repeats", "2",
        "--speedup-ratio", "4",
    )  # fmt: skip
    profile = Profile.load(out)
    assert summary["profile_id"] == profile.profile_id
    assert summary["fit"] == profile.fit.to_mapping()
    assert (tmp_path / "mock.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert profile.prompt_tokens == (256, 1024) and profile.batch_sizes == (1, 4)
    assert profile.meta["engine"] == "mock" and profile.meta["time_scale"] == 4.0
    # Scaled back by the speedup: a prefill of 1024 tokens is modelled at 16.5 + 15.54 + 0.44 = 32.5 ms, and a
    # measured step is never shorter than its model (a sleep does not end early).
    assert profile.prefill[1].median_ms >= MockEngineConfig().step_time_model.prefill_ms(1024) * (1 - 1e-3)


def test_a_malformed_profile_stops_the_worker_with_why(tmp_path, runtime_config, namespace):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "kvmesh-profile", "version": 1, "max_num_batched_tokens": -3}')
    done = subprocess.run(
        worker_command(namespace, "--profile", str(bad)), cwd=ROOT, env=worker_env(runtime_config), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "bad profile field 'max_num_batched_tokens'" in done.stderr


async def test_a_worker_started_with_a_profile_registers_its_coefficients(
    tmp_path, make_runtime, runtime_config, namespace
):
    # A profile with known numbers (not measured: what is tested is the announcement): prefill 10 ms + 0.05 ms a
    # token, decode 3 ms + 0.1 ms a sequence + 1e-4 ms a KV token, exactly on its grid, so the fit recovers them.
    true = StepTimeModel(10.0, 0.05, 0.0, 3.0, 0.1, 1e-4, 4096)
    xs, bs, cs = [128, 1024, 4096], [1, 8], [256.0, 2048.0]
    profile = Profile.build(
        prompt_tokens=xs,
        prefill_samples_ms=[[true.prefill_ms(n)] for n in xs],
        batch_sizes=bs,
        context_tokens=cs,
        decode_samples_ms=[[[true.decode_ms(b, b * c)] for c in cs] for b in bs],
        max_num_batched_tokens=4096,
        meta={"engine": "synthetic"},
    )
    path = tmp_path / "profile.json"
    profile.save(path)
    proc = subprocess.Popen(  # noqa: ASYNC220
        worker_command(namespace, "--profile", str(path)),
        cwd=ROOT,
        env=worker_env(runtime_config),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        iid = await ready_instance_id(proc)
        crt = await make_runtime()
        client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(1, timeout_s=5)
        (instance,) = [i for i in client.instances() if i.instance_id == iid]
        meta = WorkerMetadata.from_dict(instance.metadata)
        assert meta.profile_id == profile.profile_id
        assert meta.step_time == profile.fit.to_mapping()
        announced = StepTimeModel.from_mapping(meta.step_time)
        for name in ("prefill_base_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq"):
            assert getattr(announced, name) == pytest.approx(getattr(true, name), rel=1e-6), name
        assert announced.max_num_batched_tokens == 4096
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
