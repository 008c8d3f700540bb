"""Typed errors of the frontend, one small hierarchy (STYLE.md habit 7). Each carries what the OpenAI error body
needs (``param``, ``code``); ``app.py`` alone turns them into HTTP statuses.
"""

from __future__ import annotations


class FrontendError(Exception):
    """Root of every error raised by ``components.frontend``."""

    param: str | None = None
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class InvalidRequestError(FrontendError):
    """The request body is malformed, mistyped, or asks for something kvmesh does not do."""


class MalformedJsonError(InvalidRequestError):
    code = "invalid_json"


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"

    def __init__(self, param: str, detail: str = "") -> None:
        super().__init__(f"'{param}' is not supported by kvmesh{': ' + detail if detail else ''}", param=param)


class ContextLengthError(InvalidRequestError):
    """Prompt, or prompt + max_tokens, exceeds the model's max_model_len."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(message, param=param)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class AuthenticationError(FrontendError):
    code = "invalid_api_key"


class ModelNotFoundError(FrontendError):
    code = "model_not_found"

    def __init__(self, model: str, known: list[str]) -> None:
        listed = ", ".join(known) if known else "none"
        super().__init__(f"The model '{model}' does not exist (served models: {listed}).", param="model")
        self.model = model


class ServiceUnavailableError(FrontendError):
    """No worker can take the request right now; the client should retry shortly."""

    code = "no_workers"


class ModelUnavailableError(FrontendError):
    """The model's workers exist but the frontend cannot serve it (its tokenizer did not load)."""

    code = "model_unavailable"


class UpstreamError(FrontendError):
    """The worker failed the request (after retries, or after tokens were already sent)."""

    code = "upstream_error"


class UpstreamTimeoutError(UpstreamError, TimeoutError):
    code = "upstream_timeout"
