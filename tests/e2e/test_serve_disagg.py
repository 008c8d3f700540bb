"""`kvmesh serve` of the disaggregated graphs end to end: graphs/mock_disagg.yaml (2 simulated prefill workers, 2
decode workers) here, and graphs/disagg.yaml (1 vLLM prefill worker, 1 vLLM decode worker) in test_serve_vllm.py
(where it takes its reference tokens from the agg graph that module serves anyway), each behind its frontend, talked
to with the official openai client. The helpers below serve both.

A prompt goes through the prefill queue when its uncached part is over ``max_local_prefill_length`` tokens (1000 in
both graphs; tiny-llama's tokenizer is byte-level, so a 1,500-character ASCII prompt is ~1,500 tokens). That it did
is read from outside, as an operator would: each prefill worker's ``items_done`` (in its ``PrefillQueueReport``,
shown by ``kvmesh status --json``) counts the items it settled, so two long prompts make 2 and short ones 0. Every
long prompt here starts differently: a decode worker's prefix cache holding one would make its uncached part short.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_serve import ROOT, Serve, http_get, run_kvmesh, serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MOCK_DISAGG = ROOT / "graphs" / "mock_disagg.yaml"
MOCK_NS = "mock-disagg"
MODEL = "tiny-llama"
# Simulated engines without sleeps: the test is about where prompts go, not how long steps take.
MOCK_FAST = ["--set", "frontend.port=0"] + [
    arg for i in (0, 1) for arg in ("--set", f"workers[{i}].speedup_ratio=.inf")
]
LONG_CHARS = 1500  # > max_local_prefill_length (1000) tokens, < max_model_len (2048) with the output
SHORT_PROMPT = "hello there"


def long_prompt(tag: str) -> str:
    """~LONG_CHARS tokens that share no prefix with another tag's (the tag comes first)."""
    text = f"{tag}: " + " ".join(f"the mesh moves block {i} of the prompt to the decode worker." for i in range(40))
    return text[:LONG_CHARS]


def openai_client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def metric(url: str, name: str, model: str = MODEL) -> float | None:
    """One sample of the frontend's /metrics (None when absent)."""
    _, body = http_get(f"{url}/metrics")
    m = re.search(rf'^{name}{{model="{re.escape(model)}"}} (\S+)$', body.decode(), re.MULTILINE)
    return float(m.group(1)) if m else None


def wait_for_prefill_workers(url: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the frontend hears ``n`` prefill workers (decode workers hear the same reports, subscribed since before
    they registered, so they count them too by then)."""
    deadline = time.monotonic() + timeout_s
    while (got := metric(url, "kvmesh_frontend_prefill_queue_prefill_workers")) != n:
        if time.monotonic() > deadline:
            pytest.fail(f"the frontend heard {got} prefill workers, not {n}, within {timeout_s} s")
        time.sleep(0.2)


def status_rows(serve: Serve, namespace: str) -> list[dict[str, Any]]:
    done = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", namespace, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def items_done(rows: list[dict[str, Any]]) -> int:
    """Items the prefill workers settled, from their last reports (each must have been heard)."""
    prefill = [r for r in rows if r["role"] == "prefill"]
    assert prefill and all(r["prefill_report"] is not None for r in prefill), prefill
    return sum(r["prefill_report"]["items_done"] for r in prefill)


def complete(client: Any, prompt: str, max_tokens: int, **kw: Any) -> tuple[str, int]:
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **kw)
    assert done.usage is not None and done.choices[0].finish_reason == "length"
    return done.choices[0].text, done.usage.completion_tokens


def complete_streaming(client: Any, prompt: str, max_tokens: int, **kw: Any) -> tuple[str, int]:
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    chunks = list(stream)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


# -- graphs/mock_disagg.yaml -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mock_disagg(tmp_path_factory) -> Iterator[tuple[Serve, str]]:
    state_dir = tmp_path_factory.mktemp("state")
    with serving(state_dir, *MOCK_FAST, graph=MOCK_DISAGG) as serve:
        url = serve.wait_ready()
        wait_for_prefill_workers(url, 2)
        yield serve, url


def test_short_prompts_stay_on_the_decode_workers_and_long_ones_go_through_the_queue(mock_disagg):
    serve, url = mock_disagg
    client = openai_client(url)
    assert [m.id for m in client.models.list().data] == [MODEL]
    before = items_done(status_rows(serve, MOCK_NS))
    ignore_eos = {"extra_body": {"ignore_eos": True}}

    # Short: prefilled by the decode worker itself; the queue never sees them.
    assert complete(client, SHORT_PROMPT, 8, **ignore_eos)[1] == 8
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **ignore_eos,
    )
    chunks = list(chat)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert items_done(status_rows(serve, MOCK_NS)) == before

    # Long: each one goes through the prefill queue; the client sees one ordinary response, whole.
    assert complete(client, long_prompt("a"), 12, **ignore_eos)[1] == 12
    text, n = complete_streaming(client, long_prompt("b"), 12, **ignore_eos)
    assert n == 12 and text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_prompt("c")}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        **ignore_eos,
    )
    chunks = list(chat)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens > 1000

    rows = status_rows(serve, MOCK_NS)
    assert items_done(rows) == before + 3
    # The queue drained: nothing waits or is in flight, both prefill workers alive (the freshest report's numbers).
    queue = next(r["prefill_queue"] for r in rows if r["role"] == "decode")
    assert (queue["waiting"], queue["in_flight"], queue["prefill_workers"], queue["redelivered"]) == (0, 0, 2, 0)
    assert metric(url, "kvmesh_frontend_prefill_queue_waiting") == 0
    assert metric(url, "kvmesh_frontend_prefill_queue_in_flight") == 0
    assert metric(url, "kvmesh_frontend_prefill_queue_redelivered") == 0
    assert metric(url, "kvmesh_frontend_prefill_queue_prefill_workers") == 2
    # The decode workers say how they take a remote prefill: simulated engines receive the KV.
    _, body = http_get(f"{url}/metrics")
    info = re.findall(r"^kvmesh_frontend_worker_info\{(.*)\} 1\.0$", body.decode(), re.MULTILINE)
    assert len(info) == 2 and all('role="decode"' in i and 'remote_prefill_mode="kv_transfer"' in i for i in info)


def test_status_shows_the_roles_and_the_prefill_queue_line(mock_disagg):
    serve, _ = mock_disagg
    done = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", MOCK_NS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = lines[0].split()
    assert header[:7] == ["NAMESPACE", "COMPONENT", "INSTANCE", "MODEL", "WATCHER", "PID", "ROLE"]
    rows = [line.split() for line in lines[1 : lines.index("4 instances")]]
    # Simulated engines transfer KV: plain roles (recompute would be shown as decode:recompute).
    assert sorted((r[4], r[6]) for r in rows) == [
        ("mock-disagg-decode-0", "decode"),
        ("mock-disagg-decode-0", "decode"),
        ("mock-disagg-prefill-0", "prefill"),
        ("mock-disagg-prefill-1", "prefill"),
    ]
    after = lines[lines.index("4 instances") + 1 :]
    assert after.pop(0) == "mock-disagg: pools tiny-llama: decode 2 workers, prefill 2 workers"
    assert re.fullmatch(
        r"mock-disagg: prefill queue tiny-llama: 0 waiting, 0 in flight, oldest \d+\.\d s, 2 prefill workers, "
        r"0 redelivered",
        after[0],
    ), after
    assert [line.split()[:3] for line in after[1:]] == [
        ["mock-disagg:", "embedded", "etcd"],
        ["mock-disagg:", "embedded", "nats"],
    ]
