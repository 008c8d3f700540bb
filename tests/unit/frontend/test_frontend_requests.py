"""Request bodies: parsing, the 400s they deserve, and their mapping to a worker's SamplingParams (no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from components.frontend.errors import (
    ContextLengthError,
    InvalidRequestError,
    MalformedJsonError,
    UnsupportedParameterError,
)
from components.frontend.models import Model
from components.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from components.frontend.service import build_sampling
from components.frontend.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

MODEL_PATH = str(Path(__file__).resolve().parents[3] / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(MODEL_PATH)


def model(max_model_len: int = 100) -> Model:
    return Model("m", MODEL_PATH, max_model_len, 0, {})


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": "hi"} | fields).encode())


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def test_sampling_parameters_carry_over_and_default_like_openai(tok: Tokenizer):
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, ignore_eos=True, user="u1")
    sp, stops = build_sampling(req, model(), tok, [1, 2, 3], req.max_tokens, "prompt", 16, chat=False)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.ignore_eos) == (7, 0.5, 0.9, 40, 3, True)
    assert stops == [] and sp.stop_token_ids == []

    req = completion()
    sp, _ = build_sampling(req, model(), tok, [1, 2, 3], None, "prompt", 16, chat=False)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (16, 1.0, 1.0, -1, None)


def test_default_max_tokens_never_exceeds_the_context(tok: Tokenizer):
    # Completions: min(16, room); chat: all the room there is (100 - 95 = 5 tokens here).
    sp, _ = build_sampling(completion(), model(100), tok, [1] * 95, None, "prompt", 16, chat=False)
    assert sp.max_tokens == 5
    sp, _ = build_sampling(chat(), model(100), tok, [1] * 40, None, "messages", 16, chat=True)
    assert sp.max_tokens == 60


def test_context_limits_name_the_parameter_at_fault(tok: Tokenizer):
    with pytest.raises(ContextLengthError) as e:
        build_sampling(completion(), model(100), tok, [1] * 100, None, "prompt", 16, chat=False)
    assert (e.value.param, e.value.num_prompt_tokens, e.value.max_model_len) == ("prompt", 100, 100)
    with pytest.raises(ContextLengthError) as e:
        build_sampling(completion(max_tokens=11), model(100), tok, [1] * 90, 11, "prompt", 16, chat=False)
    assert e.value.param == "max_tokens" and "at most 10" in e.value.message
    req = chat(max_completion_tokens=61)
    with pytest.raises(ContextLengthError) as e:
        build_sampling(req, model(100), tok, [1] * 40, req.requested_max_tokens, "messages", 16, chat=True)
    assert e.value.param == "max_completion_tokens"
    # Exactly at the limit is fine: 90 + 10 = 100.
    sp, _ = build_sampling(completion(max_tokens=10), model(100), tok, [1] * 90, 10, "prompt", 16, chat=False)
    assert sp.max_tokens == 10


def test_single_token_stop_strings_become_stop_token_ids(tok: Tokenizer):
    req = completion(stop=["x", "<|user|>", "xy", "\n"], stop_token_ids=[5])
    sp, stops = build_sampling(req, model(), tok, [1], None, "prompt", 16, chat=False)
    # 'x' is byte token 120, '\n' byte 10, '<|user|>' special token 260; 'xy' takes two tokens: text check only.
    assert sp.stop_token_ids == [5, 120, 260, 10]
    assert stops == ["x", "<|user|>", "xy", "\n"]


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        (b"{", MalformedJsonError, None),
        (b'"just a string"', InvalidRequestError, None),
        (b'{"model": "m"}', InvalidRequestError, "prompt"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', InvalidRequestError, "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 1.5}', InvalidRequestError, "max_tokens"),
        (b'{"model": "m", "prompt": "x", "top_p": 0}', InvalidRequestError, "top_p"),
        (b'{"model": "m", "prompt": "x", "top_k": 0}', InvalidRequestError, "top_k"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', InvalidRequestError, "stream"),
        (b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}', InvalidRequestError,
         "stream_options"),
        (b'{"model": "m", "prompt": [1, "a"]}', InvalidRequestError, "prompt"),
        (b'{"model": "m", "prompt": []}', InvalidRequestError, "prompt"),
        (b'{"model": "m", "prompt": "x", "stop": [""]}', InvalidRequestError, "stop"),
        (b'{"model": "m", "prompt": "x", "n": 3}', UnsupportedParameterError, "n"),
        (b'{"model": "m", "prompt": "x", "echo": true}', UnsupportedParameterError, "echo"),
        (b'{"model": "m", "prompt": "x", "suffix": "z"}', UnsupportedParameterError, "suffix"),
        (b'{"model": "m", "prompt": "x", "presence_penalty": 0.5}', UnsupportedParameterError, "presence_penalty"),
        (b'{"model": "m", "prompt": "x", "logit_bias": {"5": 1}}', UnsupportedParameterError, "logit_bias"),
        (b'{"model": "m", "prompt": [[1], [2]]}', UnsupportedParameterError, "prompt"),
        (b'{"model": "m", "prompt": "x", "min_tokens": 3}', UnsupportedParameterError, "min_tokens"),
    ],
)  # fmt: skip
def test_bad_completion_bodies(body: bytes, error: type[Exception], param: str | None):
    with pytest.raises(error) as e:
        req = parse_request(CompletionRequest, body)
        req.stop_strings()
        req.prompt_input()
    assert isinstance(e.value, InvalidRequestError) and e.value.param == param


def test_neutral_values_of_unsupported_fields_pass():
    req = completion(n=1, best_of=1, echo=False, logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                     logit_bias={}, store=False, metadata={"k": "v"}, service_tier="auto")  # fmt: skip
    assert req.prompt_input() == "hi"
    c = chat(logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"}, modalities=["text"])
    assert c.conversation() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]"),
    ],
)
def test_unsupported_chat_features_are_named(fields: dict[str, Any], param: str):
    with pytest.raises(UnsupportedParameterError) as e:
        chat(**fields).conversation()
    assert e.value.param == param


def test_prompt_forms_and_text_parts():
    assert completion(prompt=[1, 2]).prompt_input() == [1, 2]
    assert completion(prompt=[[1, 2]]).prompt_input() == [1, 2]
    assert completion(prompt=["only"]).prompt_input() == "only"
    c = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": None, "name": "bot"}])  # fmt: skip
    assert c.conversation() == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_completion_tokens=6).requested_max_tokens == 6
    with pytest.raises(InvalidRequestError):
        chat(max_tokens=5, max_completion_tokens=6)


def test_chat_template_is_applied_with_the_generation_prompt(tok: Tokenizer):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # <|bos|> <|user|> h i <|eos|> <|assistant|>: the template's own special tokens, none added twice.
    assert ids == [256, 260, 104, 105, 257, 261]
