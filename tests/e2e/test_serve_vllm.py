"""`kvmesh serve` on real vLLM workers (the CPU build, models/tiny-llama), end to end with the official openai client:

- graphs/agg.yaml, the default graph: two workers, greedy determinism across them, and a clean stop;
- graphs/disagg.yaml: one prefill and one decode worker, whose greedy tokens for two long prompts (through the
  prefill queue) must be the agg graph's.

The disagg test's reference tokens come from the agg graph the first test serves anyway (``agg_reference``, filled by
that test before it stops the graph): serving agg again only for them cost ~35 s of the 2-core machine (its own start
of etcd, nats, a frontend and a vLLM worker, then the stop). A run without the first test (``-k disagg``, or the first
test failed before it got there) serves agg itself for them, as the disagg test always did.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.test_serve import ROOT, http_get, run_kvmesh, serving, wait_gone
from tests.e2e.test_serve_disagg import (
    MODEL,
    SHORT_PROMPT,
    complete,
    complete_streaming,
    items_done,
    long_prompt,
    openai_client,
    status_rows,
    wait_for_prefill_workers,
)
from tests.support.vllm import HAVE_NIXL, check_weights, requires_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400), requires_vllm]

AGG = ROOT / "graphs" / "agg.yaml"
DISAGG = ROOT / "graphs" / "disagg.yaml"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = {"a": long_prompt("a"), "b": long_prompt("b")}  # each over max_local_prefill_length: through the queue
REFERENCE_TOKENS = 16


def agg_reference_completions(client) -> dict[str, tuple[str, int]]:
    """The agg graph's greedy (text, completion tokens) of the long prompts: "a" plain, "b" streamed."""
    return {
        "a": complete(client, LONG["a"], REFERENCE_TOKENS, **GREEDY),
        "b": complete_streaming(client, LONG["b"], REFERENCE_TOKENS, **GREEDY),
    }


@pytest.fixture(scope="module")
def agg_reference() -> dict[str, tuple[str, int]]:
    """Filled by the first test that serves graphs/agg.yaml (module docstring)."""
    return {}


def test_default_graph_serves_openai_requests_on_real_vllm(tmp_path, agg_reference):
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
        # For the disagg test below (whichever worker serves them: greedy tokens are the same on both, as above).
        agg_reference.update(agg_reference_completions(openai_client(url)))
        records = state.all_processes()
    # Leaving `serving` sent SIGTERM to serve: every process it started (vLLM engine cores included) is gone.
    assert wait_gone(records, 90) == []


@pytest.mark.timeout(900)
def test_disagg_graph_gives_agg_graphs_greedy_tokens_on_real_vllm(tmp_path: Path, agg_reference):
    """graphs/agg.yaml's greedy tokens of two long prompts (from the test above, or served here for them: one replica,
    the tokens do not depend on how many); then graphs/disagg.yaml, whose decode worker sends both through the
    prefill queue and must produce the same greedy tokens, streamed or not. With NIXL installed the decode worker
    pulls the prompts' KV from the prefill worker (kv_transfer); without it, it recomputes them, and every surface
    says which."""
    check_weights()
    if len(agg_reference) < len(LONG):
        with serving(tmp_path / "agg", "--set", "frontend.port=0", "--set", "workers[0].replicas=1", graph=AGG) as s:
            agg_reference.update(agg_reference_completions(openai_client(s.wait_ready(timeout_s=300))))
            records = s.state("kvmesh").all_processes()
        assert wait_gone(records, 90) == []  # vLLM engine cores included: the next serve gets the CPUs
    want_a, want_b = agg_reference["a"], agg_reference["b"]
    assert want_a[1] == want_b[1] == REFERENCE_TOKENS

    with serving(tmp_path / "disagg", "--set", "frontend.port=0", graph=DISAGG) as serve:
        url = serve.wait_ready(timeout_s=300)
        wait_for_prefill_workers(url, 1)
        client = openai_client(url)
        assert [m.id for m in client.models.list().data] == [MODEL]
        before = items_done(status_rows(serve, "disagg"))

        assert complete(client, SHORT_PROMPT, 4, **GREEDY)[1] == 4  # prefilled on the decode worker
        assert complete(client, LONG["a"], REFERENCE_TOKENS, **GREEDY) == want_a
        assert complete_streaming(client, LONG["b"], REFERENCE_TOKENS, **GREEDY) == want_b

        rows = status_rows(serve, "disagg")
        assert items_done(rows) == before + 2  # both long prompts, not the short one
        mode = "kv_transfer" if HAVE_NIXL else "recompute"
        assert sorted((r["role"], r["remote_prefill_mode"]) for r in rows if r["role"]) == [
            ("decode", mode),
            ("prefill", mode),
        ]
        table = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", "disagg").stdout
        # The ROLE column marks a worker that recomputes (decode:recompute); one that moves KV shows its plain role.
        lines = table.splitlines()
        roles = {line.split()[6] for line in lines[1 : lines.index("2 instances")]}
        assert roles == ({"decode", "prefill"} if HAVE_NIXL else {"decode:recompute", "prefill:recompute"}), table
        assert "disagg: prefill queue tiny-llama: 0 waiting, 0 in flight" in table
        _, body = http_get(f"{url}/metrics")  # ...and /metrics says it too
        info = re.findall(r"^kvmesh_frontend_worker_info\{(.*)\} 1\.0$", body.decode(), re.M)
        assert len(info) == 1 and 'role="decode"' in info[0] and f'remote_prefill_mode="{mode}"' in info[0], info
        records = serve.state("disagg").all_processes()
    assert wait_gone(records, 90) == []
