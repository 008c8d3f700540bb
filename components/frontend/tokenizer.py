"""Text <-> token ids for the frontend: a model's tokenizer (loaded once, off the event loop), its chat template, and
the per-request output side: incremental detokenisation and stop strings.

Workers see token ids only; everything textual happens here.

Incremental detokenisation follows vLLM's ``detokenize_incrementally``: decode a short window of tokens twice (with
and without the newest ones) and emit the difference, unless the window ends in U+FFFD, which means a multi-byte UTF-8
character is not complete yet; those bytes wait for the next chunk. It runs once per chunk the worker sends, not once
per token, and its cost does not grow with the length of the output (a window starts at most a few tokens back).

Imports no HTTP and no mesh client; ``transformers`` only inside ``load_tokenizer``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from components.frontend.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# Prompt tokens that seed the detokeniser's window: SentencePiece tokenizers drop a leading space when decoding from
# the start of a sequence, so the first output token needs some context to decode as it will read (vLLM uses 5).
_CONTEXT_TOKENS = 5


class Tokenizer:
    """A loaded tokenizer: what the frontend needs of a Hugging Face tokenizer, nothing more."""

    def __init__(self, hf: Any, path: str) -> None:
        self._hf = hf
        self.path = path
        self.vocab_size = len(hf)
        self.has_chat_template = getattr(hf, "chat_template", None) is not None
        self._single_token_stops: dict[str, int | None] = {}
        # The detokeniser decodes twice per chunk from the worker, and a chunk is often one token. transformers'
        # decode() wraps the Rust tokenizer's in ~7 us of argument conversion per call (1.8 of 10.5 CPU-s in a
        # profile of 2000 streamed requests of 64 tokens); call the Rust one directly when nothing else is needed.
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None and not getattr(hf, "clean_up_tokenization_spaces", False):
            self._backend_decode = backend.decode
        else:
            self._backend_decode = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return str(self._backend_decode(token_ids, skip_special_tokens=skip_special_tokens))
        return str(self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render a conversation with the model's template and tokenise it.

        The template already writes the special tokens it wants (BOS, role markers), so the text is encoded without
        adding more, as vLLM does.
        """
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template's own raise_exception() ("roles must alternate", ...)
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from e
        return self.encode(str(text), add_special_tokens=False)

    def single_token_stop(self, stop: str) -> int | None:
        """The token id whose text is exactly ``stop``, or None.

        A worker can stop at such a token itself (``stop_token_ids``), which saves generating past it while the
        frontend's text check catches up. Exact means: ``stop`` encodes to one token and that token decodes back to
        ``stop``. Special tokens count (a stop of ``"<|user|>"`` works even though the text hides them).
        """
        if stop not in self._single_token_stops:
            ids = self.encode(stop, add_special_tokens=False)
            exact = len(ids) == 1 and self.decode(ids, skip_special_tokens=False) == stop
            if len(self._single_token_stops) < 4096:  # bounded: stop strings come from clients
                self._single_token_stops[stop] = ids[0] if exact else None
            return ids[0] if exact else None
        return self._single_token_stops[stop]


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from a local directory (blocking: call it in a thread). Never reaches for a hub."""
    from transformers import AutoTokenizer  # heavy (~1 s): imported only when a model first appears

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Tokenizer(hf, path)


class IncrementalDetokenizer:
    """Output token ids -> text, chunk by chunk, never emitting half a UTF-8 character."""

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = tokenizer.decode
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        # A token-id prompt may end inside a character; such a context would swallow the first output bytes.
        if context and _REPLACEMENT in self._decode(context):
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def feed(self, token_ids: Sequence[int]) -> str:
        """Text that ``token_ids`` complete; may be empty (an unfinished character, a special token)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the output: whatever is left, less the replacement characters an incomplete UTF-8 character
        at the very end decodes to (the output stopped inside it: vLLM's server sends nothing for those bytes either;
        a replacement character inside the text, an invalid byte the model really produced, is kept)."""
        return self._advance(final=True).rstrip(_REPLACEMENT)

    def _advance(self, final: bool) -> str:
        ids, p, r = self._ids, self._prefix_offset, self._read_offset
        prefix_text = self._decode(ids[p:r]) if r > p else ""
        new_text = self._decode(ids[p:])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        if r > 64:  # keep the list from growing with the output: only ids[prefix_offset:] are decoded again
            del ids[:r]
            r = 0
        self._prefix_offset = r
        self._read_offset = len(ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Cuts the output text at the first stop string; holds back a tail that may be the start of one.

    Streaming cannot take text back, so a tail of the text that is the beginning of a stop string (at most
    ``max(len(stop)) - 1`` characters) waits until the next chunk shows whether the stop string follows. Each ``feed``
    looks only at the held-back tail plus the new text: an occurrence that ends in the new text starts at most
    ``len(stop) - 1`` characters earlier, inside the held-back tail.
    """

    __slots__ = ("_hold", "_pending", "_stops", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)
        self._hold = max(len(s) for s in stops) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit; sets ``stopped`` (and drops everything from the stop string on) when one appears."""
        if self.stopped:
            return ""
        buf = self._pending + text
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        # Hold back only the longest tail that could still grow into a stop string ("ST" for "STOP"), so text with
        # no such tail streams out at once.
        held = 0
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                held = k
                break
        keep = len(buf) - held
        self._pending = buf[keep:]
        return buf[:keep]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
