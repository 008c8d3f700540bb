"""Unit tests of the load generator's pure parts: trace readers, Mooncake expansion, schedule, SSE accounting,
percentiles, CPU accounting on a fake /proc, the loopback rule and the CLI's refusals. No network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from components.cli.bench.loadgen import LoadConfig, RemoteTargetError, TraceFormatError, run_load
from components.cli.bench.loadgen.client import _Stream, request_body
from components.cli.bench.loadgen.config import base_url, is_loopback_host
from components.cli.bench.loadgen.errors import LoadgenError
from components.cli.bench.loadgen.stats import Aggregate, RequestResult, percentile, read_cpu_ticks, summarize_ms
from components.cli.bench.loadgen.traces import RequestSpec, build_request, replay_schedule, select_rows
from components.cli.main import main as cli_main
from components.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeBlocks,
    TraceRow,
    detect_format,
    read_azure,
    read_mooncake,
    read_sharegpt,
    read_trace,
    token_ids,
)

pytestmark = pytest.mark.unit

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"


def write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(**kw) -> LoadConfig:
    return LoadConfig(model="m", **kw)


# --- Readers ----------------------------------------------------------------------------------------------------------


def test_mooncake_reader_converts_ms_and_keeps_hash_ids(tmp_path):
    p = write_mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 512, "output_length": 3, "hash_ids": [0]},
        ],
    )
    rows = list(read_mooncake(p))
    assert rows == [
        TraceRow(index=0, timestamp_s=0.0, input_length=700, output_length=5, hash_ids=(0, 1)),
        TraceRow(index=1, timestamp_s=1.5, input_length=512, output_length=3, hash_ids=(0,)),
    ]
    assert detect_format(p) == "mooncake"


def test_mooncake_reader_names_the_line_of_a_bad_row(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n\n{"timestamp": 5}\n')
    with pytest.raises(TraceFormatError) as e:
        list(read_mooncake(p))
    assert e.value.line == 3 and "input_length" in str(e.value)


def test_mooncake_reader_refuses_a_prompt_longer_than_its_blocks(tmp_path):
    # 2 blocks hold 1024 tokens; 1025 cannot be expanded honestly.
    p = write_mooncake(
        tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}]
    )
    with pytest.raises(TraceFormatError, match="longer than its 2 blocks"):
        list(read_mooncake(p))


def test_azure_reader_counts_time_from_the_first_row(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    rows = list(read_azure(p))
    assert detect_format(p) == "azure"
    assert [(r.input_length, r.output_length) for r in rows] == [(374, 44), (396, 109)]
    assert rows[0].timestamp_s == 0.0
    # 50.995169 - 46.680590 (the 7th fractional digit is dropped) = 4.314579 s
    assert rows[1].timestamp_s == pytest.approx(4.314579, abs=1e-6)


def test_azure_reader_names_a_missing_column(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,374\n")
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        list(read_azure(p))


def test_sharegpt_reader_takes_the_first_human_turn_and_skips_the_rest(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(
        json.dumps(
            [
                {"id": "a", "conversations": [{"from": "human", "value": "first"}, {"from": "human", "value": "x"}]},
                {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "second"}]},
                {"id": "c", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
                {"id": "d", "conversations": []},
            ]
        )
    )
    assert detect_format(p) == "sharegpt"
    assert [(r.index, r.text, r.timestamp_s) for r in read_sharegpt(p)] == [(0, "first", None), (1, "second", None)]


def test_unknown_format_and_missing_file_are_clear_errors(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello world\n")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        detect_format(p)
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("mooncake_conversation_trace.jsonl", "mooncake"),
        ("AzureLLMInferenceTrace_conv.csv", "azure"),
        ("sharegpt_v3_filtered_500.json", "sharegpt"),
    ],
)
def test_the_shared_traces_read_as_documented(name, fmt):
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    assert detect_format(path) == fmt
    rows = list(select_rows(read_trace(path), 0.0, 5))
    assert len(rows) == 5
    if fmt == "mooncake":
        # The first rows of conversation_trace.jsonl (README of the traces): all at t=0, sharing block 0.
        assert rows[0] == TraceRow(0, 0.0, 6758, 500, tuple(range(14)))
        assert all(r.hash_ids[0] == 0 and r.timestamp_s == 0.0 for r in rows)
    elif fmt == "azure":
        assert (rows[0].timestamp_s, rows[0].input_length, rows[0].output_length) == (0.0, 374, 44)
        assert rows[1].timestamp_s == pytest.approx(4.314579, abs=1e-6)
    else:
        assert rows[0].text == "Hi! I'm going to visit Vigo for a day, what should I visit?"


# --- Prompts ----------------------------------------------------------------------------------------------------------


def test_token_ids_are_a_pure_function_of_the_key_and_lie_in_the_vocabulary():
    a = token_ids("0:prompt:1", 1000, 384)
    assert a == token_ids("0:prompt:1", 1000, 384)
    assert a != token_ids("0:prompt:2", 1000, 384)
    assert len(a) == 1000 and min(a) >= 0 and max(a) < 384
    assert len(set(a)) > 300  # spread over the vocabulary, not a constant


def test_equal_hash_ids_give_equal_prefix_blocks_and_the_length_is_input_length():
    blocks = MooncakeBlocks(vocab_size=256, seed=0)
    b = MOONCAKE_BLOCK_TOKENS
    p1 = blocks.prompt([0, 1, 2], 2 * b + 100)
    p2 = blocks.prompt([0, 1, 7], 2 * b + 40)
    p3 = blocks.prompt([0, 9], b + 1)
    assert (len(p1), len(p2), len(p3)) == (2 * b + 100, 2 * b + 40, b + 1)
    assert p1[: 2 * b] == p2[: 2 * b]  # shared ids 0, 1: a shared 1024-token prefix
    assert p1[2 * b : 2 * b + 40] != p2[2 * b :]  # ids 2 and 7 differ
    assert p3[:b] == p1[:b] and p3[b:] != p1[b : b + 1]
    assert p1[2 * b :] == blocks.block(2)[:100]  # the last block is cut, not another one drawn


def test_block_contents_do_not_depend_on_the_cache():
    big = MooncakeBlocks(vocab_size=256, seed=0)
    tiny = MooncakeBlocks(vocab_size=256, seed=0, max_cached=1)
    for h in [5, 6, 5, 7, 5]:
        assert tiny.block(h) == big.block(h)
    assert MooncakeBlocks(vocab_size=256, seed=1).block(5) != big.block(5)


def test_build_request_applies_caps_and_picks_the_endpoint():
    blocks = MooncakeBlocks(256, 0)
    row = TraceRow(index=3, timestamp_s=0.0, input_length=1500, output_length=500, hash_ids=(0, 1, 2))
    full = build_request(row, cfg(), blocks)
    capped = build_request(row, cfg(max_input_tokens=600, max_output_tokens=32), blocks)
    assert (len(full.prompt), full.max_tokens, full.chat) == (1500, 500, False)
    assert (len(capped.prompt), capped.max_tokens) == (600, 32)
    assert capped.prompt == full.prompt[:600]  # the start is kept: shared prefixes stay shared
    assert request_body(full, "m", True)[0] == "/v1/completions"

    text = build_request(TraceRow(index=0, text="hi"), cfg(max_tokens=7), blocks)
    path, body = request_body(text, "m", False)
    assert (text.chat, text.max_tokens, text.prompt_tokens) == (True, 7, None)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in body and body["stream_options"] == {"include_usage": True}

    # extra_body: a server's extension fields go into every body; the request's own fields win over them.
    extra = {"nvext": {"annotations": ["output_replay_id:x"]}, "max_tokens": 1, "model": "other"}
    _, body = request_body(text, "m", False, extra)
    assert body["nvext"] == {"annotations": ["output_replay_id:x"]}
    assert (body["model"], body["max_tokens"]) == ("m", 7)
    assert request_body(text, "m", False, None)[1] == request_body(text, "m", False)[1]

    # Azure-like rows: distinct synthetic prompts of the row's length, seeded by the row and the seed.
    a0 = build_request(TraceRow(index=0, timestamp_s=0.0, input_length=50, output_length=0), cfg(), blocks)
    a1 = build_request(TraceRow(index=1, timestamp_s=0.0, input_length=50, output_length=5), cfg(), blocks)
    assert len(a0.prompt) == 50 and a0.prompt != a1.prompt and a0.max_tokens == 1  # 0 output tokens -> 1
    assert build_request(TraceRow(index=0, input_length=50), cfg(seed=1), blocks).prompt != a0.prompt


def test_program_id_block_names_the_conversation_in_the_user_field():
    # The conversation trace: block 0 is everyone's system prompt, block 1 the conversation's first own block.
    blocks = MooncakeBlocks(256, 0)
    turn1 = TraceRow(index=0, timestamp_s=0.0, input_length=1000, output_length=1, hash_ids=(0, 7))
    turn2 = TraceRow(index=1, timestamp_s=5.0, input_length=1500, output_length=1, hash_ids=(0, 7, 9))
    lone = TraceRow(index=2, timestamp_s=6.0, input_length=100, output_length=1, hash_ids=(0,))
    c = cfg(program_id_block=1)
    assert [build_request(r, c, blocks).user for r in (turn1, turn2, lone)] == ["conv-7", "conv-7", None]
    assert request_body(build_request(turn2, c, blocks), "m", True)[1]["user"] == "conv-7"
    assert build_request(turn2, cfg(), blocks).user is None  # off by default: no "user" field at all
    assert "user" not in request_body(build_request(turn2, cfg(), blocks), "m", True)[1]


# --- Schedule ---------------------------------------------------------------------------------------------------------


def rows_at(*ts: float) -> list[TraceRow]:
    return [TraceRow(index=i, timestamp_s=t, input_length=1, output_length=1) for i, t in enumerate(ts)]


def test_time_scale_compresses_the_schedule():
    sched = replay_schedule(rows_at(0, 1, 2.5, 10), start_offset_s=0, time_scale=0.1, max_requests=100, duration_s=60)
    assert [round(t, 9) for t, _ in sched] == [0.0, 0.1, 0.25, 1.0]


def test_start_offset_duration_and_max_requests_bound_the_schedule():
    rows = rows_at(0, 1, 2, 3, 4, 5, 6)
    # From trace second 2, at half speed: rows 2..6 are sent at 0, 0.5, 1, 1.5, 2; duration 1.6 s drops 2.0.
    sched = replay_schedule(rows, start_offset_s=2, time_scale=0.5, max_requests=100, duration_s=1.6)
    assert [(r.index, t) for t, r in sched] == [(2, 0.0), (3, 0.5), (4, 1.0), (5, 1.5)]
    sched = replay_schedule(rows, start_offset_s=2, time_scale=0.5, max_requests=2, duration_s=100)
    assert [r.index for _, r in sched] == [2, 3]
    assert [r.index for r in select_rows(rows, 4.0, 2)] == [4, 5]


def test_replay_needs_timestamps():
    with pytest.raises(ValueError, match="no timestamp"):
        replay_schedule([TraceRow(index=0, text="x")], 0, 1, 10, 10)


# --- SSE accounting ---------------------------------------------------------------------------------------------------


def chunk(text: str, usage: dict | None = None, finish: str | None = None) -> str:
    d: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = usage
    return json.dumps(d)


def test_stream_times_ttft_and_spreads_usage_tokens_evenly_over_chunks():
    # Sent at t=10.0; output chunks at 10.05, 10.07, 10.11; usage says 6 tokens: 2 per chunk. The empty chunk
    # with a finish_reason at 10.115 is a finish marker, not output.
    s = _Stream(10.0)
    events = [(10.05, chunk("ab")), (10.07, chunk("cd")), (10.11, chunk("ef")), (10.115, chunk("", finish="length"))]
    for t, data in events:
        assert s.event(data, t) is None
    s.event(json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}}), 10.12)
    s.event("[DONE]", 10.12)
    r = RequestResult(index=0)
    s.finish(r, 10.12, prompt_tokens=100)
    assert r.ttft_s == pytest.approx(0.05)
    assert r.itl_s == pytest.approx([0.02 / 2, 0.04 / 2])
    assert (r.output_tokens, r.prompt_tokens, r.usage_reported) == (6, 9, True)
    assert r.e2e_s == pytest.approx(0.12)


def test_an_empty_completion_text_is_a_token_but_a_chat_role_preamble_is_not():
    # vLLM + a byte tokenizer: the first token is half a UTF-8 character and streams as "text": "" (seen live).
    s = _Stream(0.0)
    for t, text in [(0.03, ""), (0.04, "c"), (0.05, "#")]:
        s.event(chunk(text), t)
    s.event(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}), 0.05)
    r = RequestResult(index=0)
    s.finish(r, 0.05, prompt_tokens=3)
    assert r.ttft_s == pytest.approx(0.03) and r.itl_s == pytest.approx([0.01, 0.01])

    c = _Stream(0.0)
    c.event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 0.01)
    c.event(json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}), 0.04)
    c.event(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0.05)
    r = RequestResult(index=0)
    c.finish(r, 0.05, prompt_tokens=None)
    assert (r.ttft_s, r.output_tokens, r.itl_s) == (pytest.approx(0.04), 1, [])


def test_stream_reads_cached_prompt_tokens_from_usage_details():
    s = _Stream(0.0)
    s.event(chunk("a"), 0.1)
    usage = {"prompt_tokens": 2048, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1536}}
    s.event(json.dumps({"choices": [], "usage": usage}), 0.1)
    r = RequestResult(index=0)
    s.finish(r, 0.1, prompt_tokens=None)
    assert (r.prompt_tokens, r.cached_tokens) == (2048, 1536)
    agg = Aggregate()
    agg.add(r)
    agg.add(RequestResult(index=1, prompt_tokens=100))  # no details: nothing cached
    assert (agg.prompt_tokens, agg.cached_tokens) == (2148, 1536)


def test_stream_uses_running_usage_when_chunks_carry_it():
    s = _Stream(0.0)
    s.event(chunk("a", {"completion_tokens": 1}), 0.1)
    s.event(chunk("bcd", {"completion_tokens": 4}), 0.4)  # 3 tokens in 0.3 s
    s.event(json.dumps({"choices": [], "usage": {"completion_tokens": 4}}), 0.4)
    r = RequestResult(index=0)
    s.finish(r, 0.4, prompt_tokens=None)
    assert r.itl_s == pytest.approx([0.1])
    assert (r.output_tokens, r.prompt_tokens) == (4, 0)


def test_stream_without_usage_counts_chunks_and_reports_an_error_event():
    s = _Stream(0.0)
    s.event(json.dumps({"choices": [{"delta": {"content": "x"}}]}), 0.2)
    s.event(json.dumps({"choices": [{"delta": {"content": "y"}}]}), 0.3)
    r = RequestResult(index=0)
    s.finish(r, 0.3, prompt_tokens=None)
    assert (r.output_tokens, r.usage_reported, r.ttft_s) == (2, False, pytest.approx(0.2))
    assert _Stream(0.0).event(json.dumps({"error": {"message": "engine died", "code": 500}}), 0.1) == "engine died"


# --- Percentiles and aggregation --------------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_ranks():
    v = [1.0, 2.0, 3.0, 4.0, 5.0]
    # rank = (n - 1) * p / 100: p90 -> 3.6 -> 4 + 0.6 * (5 - 4) = 4.6; p99 -> 3.96 -> 4.96
    assert [percentile(v, p) for p in (0, 50, 90, 99, 100)] == pytest.approx([1.0, 3.0, 4.6, 4.96, 5.0])
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_summarize_reports_milliseconds_and_none_for_no_samples():
    assert summarize_ms([0.003, 0.001, 0.002]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0}
    assert summarize_ms([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_aggregate_counts_errors_by_kind_and_sums_completed_tokens():
    agg = Aggregate()
    agg.add(RequestResult(index=0, ttft_s=0.1, e2e_s=0.2, itl_s=[0.01], output_tokens=5, prompt_tokens=7))
    agg.add(RequestResult(index=1, error="http_500", error_message="boom"))
    agg.add(RequestResult(index=2, error="http_500", error_message="second"))
    agg.add(RequestResult(index=3, error="timeout"))
    assert (agg.completed, agg.failed, agg.output_tokens, agg.prompt_tokens) == (1, 3, 5, 7)
    assert dict(agg.errors) == {"http_500": 2, "timeout": 1}
    assert agg.error_examples["http_500"] == "boom" and agg.usage_missing == 1


# --- CPU from /proc ---------------------------------------------------------------------------------------------------


def fake_stat(proc: Path, pid: int, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    rest = f"S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0"
    (proc / str(pid) / "stat").write_text(f"{pid} (odd) name) {rest}\n")


def test_cpu_ticks_of_a_process_and_of_its_tree(tmp_path):
    proc = tmp_path / "proc"
    fake_stat(proc, 100, 1, utime=10, stime=5, cutime=3, cstime=2)  # the watched process
    fake_stat(proc, 101, 100, utime=7, stime=1)  # its child
    fake_stat(proc, 102, 101, utime=4, stime=0, cutime=1)  # a grandchild
    fake_stat(proc, 200, 1, utime=99, stime=99)  # unrelated
    assert read_cpu_ticks(100, proc=proc) == 15
    assert read_cpu_ticks(100, include_children=True, proc=proc) == 15 + 5 + 8 + 5
    assert read_cpu_ticks(999, proc=proc) is None


# --- Target and configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.9.8.7", "localhost", "LOCALHOST", "::1", "[::1]", "::ffff:127.0.0.1"]
)
def test_loopback_hosts_are_accepted(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "example.com", "localhost.example.com", "::", "128.0.0.1"])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback_host(host)


def test_base_url_refuses_remote_unless_allowed_and_strips_v1():
    assert base_url("http://127.0.0.1:8000/v1/", False) == "http://127.0.0.1:8000"
    assert base_url("http://[::1]:8000", False) == "http://[::1]:8000"
    with pytest.raises(RemoteTargetError, match="--allow-remote") as e:
        base_url("http://10.1.2.3:8000", False)
    assert e.value.host == "10.1.2.3"
    assert base_url("https://api.example.com/v1", True) == "https://api.example.com"
    with pytest.raises(LoadgenError, match="must look like"):
        base_url("127.0.0.1:8000", False)


async def test_run_load_refuses_a_remote_url_before_sending_anything():
    with pytest.raises(RemoteTargetError):
        await run_load({"model": "m", "url": "http://192.0.2.1:8000", "max_requests": 1})


def test_bounds_must_be_finite():
    with pytest.raises(ValidationError, match="finite"):
        cfg(duration_s="inf")
    with pytest.raises(ValidationError):
        cfg(max_requests=0)


def test_cli_refuses_a_remote_url_with_a_clear_message(capsys):
    rc = cli_main(["bench", "load", "--model", "m", "--url", "http://203.0.113.5:8000", "--no-progress"])
    err = capsys.readouterr()
    assert rc == 2
    assert "not a loopback address" in err.err and "--allow-remote" in err.err and err.out == ""


def test_cli_flags_map_onto_the_config(capsys):
    from components.cli.main import build_parser
    from components.runtime.flags import model_from_args

    args = build_parser().parse_args(
        ["bench", "load", "--model", "tiny", "--concurrency", "8", "--pids", "12,34", "--time-scale", "0.1",
         "--no-progress", "--trace-format", "azure"]
    )  # fmt: skip
    c = model_from_args(LoadConfig, args)
    assert (c.model, c.concurrency, c.pids, c.time_scale, c.progress, c.trace_format) == (
        "tiny", 8, [12, 34], 0.1, False, "azure"
    )  # fmt: skip
    assert (c.max_requests, c.duration_s, c.vocab_size) == (1000, 600.0, 256)


def test_request_spec_knows_its_prompt_length():
    assert RequestSpec(0, [1, 2, 3], 4).prompt_tokens == 3


def test_cores_busy_is_the_busy_share_of_every_cpu_between_two_readings():
    from components.cli.bench.frontend import cores_busy, machine_cpu

    # 2 CPUs; between the readings 1000 jiffies passed in all (500 per CPU), 750 of them busy: 1.5 cores busy.
    assert cores_busy((100, 1000, 2), (850, 2000, 2)) == 1.5
    assert cores_busy(None, (850, 2000, 2)) is None and cores_busy((1, 2, 2), (1, 2, 2)) is None
    now = machine_cpu()  # this machine's own /proc/stat (Linux: every CI machine)
    assert now is not None and now[2] >= 1 and 0 <= now[0] <= now[1]


def test_bench_frontend_alternates_the_order_of_its_sides_round_by_round():
    # ABBA: round 0 as given, round 1 reversed, round 2 as given again; the list passed in is not changed.
    from components.cli.bench.frontend import Side, side_order

    sides = [Side("1"), Side("2"), Side("baseline")]
    names = [[s.name for s in side_order(sides, r)] for r in range(3)]
    assert names == [["1", "2", "baseline"], ["baseline", "2", "1"], ["1", "2", "baseline"]]
    assert [s.name for s in sides] == ["1", "2", "baseline"]


def test_loadgen_procs_share_out_the_load_and_their_shards_share_prefixes_but_no_prompt():
    from components.cli.bench.loadgen.procs import split
    from components.cli.bench.loadgen.traces import synthetic_prompt

    cfg = LoadConfig(
        model="m", concurrency=64, max_requests=1000, pids=[1], prompt_tokens=40, shared_prefix_tokens=30,
        num_shared_prefixes=4, synthetic_prompt="text",
    )  # fmt: skip
    shards = split(cfg, 3)
    assert [s.concurrency for s in shards] == [22, 21, 21] and [s.max_requests for s in shards] == [334, 333, 333]
    assert [(s.shard_count, s.shard_index, s.pids) for s in shards] == [(3, 0, []), (3, 1, []), (3, 2, [])]
    # The rows each shard sends (runner: index % shard_count == shard_index), same seed: disjoint prompts, and the
    # same 4 prefixes in every shard.
    sent = [[str(synthetic_prompt(s, i, 40)) for i in range(60) if i % 3 == s.shard_index] for s in shards]
    assert len({p for ps in sent for p in ps}) == 60
    assert {p[:30] for p in sent[0]} == {p[:30] for p in sent[1]} == {p[:30] for p in sent[2]}
    assert len({p[:30] for p in sent[0]}) == 4
    with pytest.raises(LoadgenError):
        split(cfg.model_copy(update={"concurrency": 2}), 3)
    with pytest.raises(ValueError):
        LoadConfig(model="m", shard_count=2, shard_index=2)


def test_loadgen_procs_merge_sums_counts_and_rates_and_takes_percentiles_over_every_request():
    from components.cli.bench.loadgen.procs import merge

    def out(done: int, rps: float, cpu_ms: float, errors: dict[str, int]) -> dict[str, Any]:
        return {
            "url": "u", "model": "m", "mode": "concurrency", "concurrency": 8, "source": "synthetic", "trace": None,
            "requests_sent": done + sum(errors.values()), "requests_completed": done,
            "requests_failed": sum(errors.values()), "requests_cancelled": 0, "duration_s": done / rps,
            "requests_per_s": rps, "output_tokens": 64 * done, "input_tokens": 100 * done,
            "cached_input_tokens": 50 * done, "output_tokens_per_s": 64 * rps, "input_tokens_per_s": 100 * rps,
            "errors": errors, "error_examples": {k: "x" for k in errors}, "usage_missing": 0, "max_in_flight": 8,
            "cpu": {"pids": {}, "pids_include_children": False, "loadgen_cpu_ms": cpu_ms},
        }  # fmt: skip

    # Two shards: 100 requests at 50/s and 300 at 150/s; TTFTs 1..100 ms and 101..400 ms.
    m = merge(
        [out(100, 50.0, 200.0, {"timeout": 1}), out(300, 150.0, 600.0, {"timeout": 2, "http_500": 1})],
        [i / 1000 for i in range(1, 401)], [0.01] * 10, [0.5] * 400,
    )  # fmt: skip
    assert (m["requests_completed"], m["requests_per_s"], m["duration_s"], m["loadgen_procs"]) == (400, 200.0, 2.0, 2)
    assert m["errors"] == {"http_500": 1, "timeout": 3} and m["cached_input_tokens"] == 20_000
    assert m["ttft_ms"]["p50"] == pytest.approx(200.5) and m["ttft_ms"]["p99"] == pytest.approx(396.01)
    assert m["cpu"]["loadgen_cpu_ms"] == 800.0 and m["cpu"]["loadgen_cpu_ms_per_request"] == 2.0
    assert m["cpu"]["loadgen_cpu_ms_per_proc"] == [200.0, 600.0]
