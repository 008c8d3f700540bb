"""The OpenAI request bodies kvmesh accepts, as strict pydantic models, and their translation into a worker's
``GenerateRequest``.

Accepted: ``model``, the prompt (``prompt`` as text or token ids; ``messages`` with text content), ``max_tokens``
(chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``user``, and the vLLM extensions ``ignore_eos``, ``top_k`` and ``stop_token_ids``.
OpenAI fields kvmesh does not implement (``n > 1``, ``logprobs``, ``best_of``, ``echo``, ``suffix``, penalties,
``logit_bias``, ``tools``/``functions``, ``response_format`` other than text, ...) are declared so that their neutral
value (``n: 1``, ``logprobs: null``, ``tools: []``) passes and anything else is a 400 naming the field. Fields that
are pure bookkeeping for OpenAI (``store``, ``metadata``, ``service_tier``, ...) are accepted and ignored. Anything
else is a 400 too: a misspelt sampling knob silently ignored would be worse than a refusal.

Validation is strict (``"max_tokens": "5"`` is a 400, as in the OpenAI API), and parsing happens straight from the
body bytes, so malformed JSON and wrong types surface as one ``InvalidRequestError`` with the offending ``param``.

Imports no HTTP: the statuses belong to ``app.py``.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components.frontend.errors import InvalidRequestError, MalformedJsonError, UnsupportedParameterError

# How a union-typed field is described when a value fits none of its types (pydantic lists one error per member).
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list holding one string or one list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage on every chunk


class _Common(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM extensions, passed to the engine.
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # OpenAI bookkeeping, accepted and ignored.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Declared only to refuse anything but their neutral value (see _check_unsupported).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise UnsupportedParameterError("n", f"n={self.n}; kvmesh generates one choice per request (n=1)")
        if self.best_of not in (None, 1):
            raise UnsupportedParameterError("best_of", "kvmesh generates one sequence per request")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise UnsupportedParameterError(name, "penalties are not implemented; send 0 or leave it out")
        if self.logit_bias:
            raise UnsupportedParameterError("logit_bias")
        if self.top_k == 0:
            raise InvalidRequestError("'top_k' must be -1 (off) or >= 1", param="top_k")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise InvalidRequestError("'stop' strings must not be empty", param="stop")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._check_common()
        if self.echo:
            raise UnsupportedParameterError("echo")
        if self.logprobs is not None:
            raise UnsupportedParameterError("logprobs")
        if self.suffix:
            raise UnsupportedParameterError("suffix")

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids. A batch (several prompts) is refused: n and batches multiply work that
        kvmesh routes one request at a time."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise InvalidRequestError("'prompt' must not be empty", param="prompt")
        if isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise UnsupportedParameterError("prompt", f"a batch of {len(p)} prompts; send one prompt per request")
        return p[0]  # type: ignore[return-value]


class TextPart(_Strict):
    type: str
    text: str | None = None
    model_config = ConfigDict(extra="allow", strict=True)  # image_url, input_audio: named in the 400 below


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        if self.tool_calls:
            raise UnsupportedParameterError(f"messages[{index}].tool_calls", "tool calling is not implemented")
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        texts = []
        for j, part in enumerate(c):
            if part.type != "text" or part.text is None:
                raise UnsupportedParameterError(
                    f"messages[{index}].content[{j}]", f"content of type {part.type!r}; only text is supported"
                )
            texts.append(part.text)
        return "\n".join(texts)  # vLLM joins text parts the same way


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self._check_common()
        if self.logprobs or self.top_logprobs is not None:
            raise UnsupportedParameterError("logprobs" if self.logprobs else "top_logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise UnsupportedParameterError(name, "tool calling is not implemented")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise UnsupportedParameterError(
                "tool_choice" if self.tool_choice not in (None, "none") else "function_call"
            )
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise UnsupportedParameterError("response_format", "only {'type': 'text'} is supported")
        for name in ("reasoning_effort", "audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise UnsupportedParameterError(name)
        if self.modalities not in (None, ["text"]):
            raise UnsupportedParameterError("modalities", "only ['text'] is supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError(
                    "'max_tokens' and 'max_completion_tokens' disagree; send one", param="max_completion_tokens"
                )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """Messages as a chat template expects them: role and text content."""
        out = []
        for i, m in enumerate(self.messages):
            d = {"role": m.role, "content": m.text(i)}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def parse_request(model: type[R], body: bytes) -> R:
    """Parse and check a body; every failure is an ``InvalidRequestError`` naming its ``param``."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None
    req.check()
    return req


def _invalid(e: ValidationError) -> InvalidRequestError:
    errors = e.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        return MalformedJsonError(f"The request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if kind == "model_type" and not first["loc"]:
        return InvalidRequestError("The request body must be a JSON object")
    loc = _param(first["loc"])
    if kind == "extra_forbidden":
        return UnsupportedParameterError(loc, "unknown parameter")
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter '{loc}'", param=loc, code="missing_required_parameter")
    # A value that fits no member of a union reports one error per member: describe the field instead of
    # repeating the first member's complaint.
    if sum(1 for x in errors if x["loc"][:1] == first["loc"][:1]) > 1:
        for i, part in enumerate(first["loc"]):
            if str(part) in _EXPECTED:
                root = _param(first["loc"][: i + 1])
                msg = f"Invalid type for '{root}': expected {_EXPECTED[str(part)]}"
                return InvalidRequestError(msg, param=root, code="invalid_type")
    return InvalidRequestError(f"Invalid value for '{loc}': {first['msg']}", param=loc, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; pydantic's union member names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "none"):
            continue  # a union member such as 'list[int]' or 'str'
        else:
            out += f".{part}" if out else part
    return out
