"""`kvmesh serve graphs/agg.yaml` end to end: the default graph, two real vLLM workers on the CPU, the official
openai client against it, greedy determinism across the two workers, and a clean stop."""

from __future__ import annotations

import pytest

from tests.e2e.test_serve import ROOT, serving, wait_gone
from tests.support.vllm import check_weights, requires_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400), requires_vllm]

AGG = ROOT / "graphs" / "agg.yaml"


def test_default_graph_serves_openai_requests_on_real_vllm(tmp_path):
    import openai

    check_weights()
    with serving(tmp_path, "--set", "frontend.port=0", graph=AGG) as serve:
        url = serve.wait_ready(timeout_s=300)
        state = serve.state("kvmesh")
        assert [w.name for w in state.watchers if w.kind == "worker"] == ["kvmesh-vllm-0", "kvmesh-vllm-1"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]

        # Greedy output is the same whichever worker serves it (round robin alternates between the two).
        texts = []
        for _ in range(4):
            done = client.completions.create(
                model="tiny-llama", prompt="The mesh", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            assert done.usage is not None and done.usage.completion_tokens == 12
            texts.append(done.choices[0].text)
        assert len(set(texts)) == 1

        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        records = state.all_processes()
    # Leaving `serving` sent SIGTERM to serve: every process it started (vLLM engine cores included) is gone.
    assert wait_gone(records, 90) == []
