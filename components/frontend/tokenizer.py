"""Text <-> token ids for the frontend: a model's tokenizer (loaded once, off the event loop), its chat template, and
the per-request output side: incremental detokenisation and stop strings.

Workers see token ids only; everything textual happens here.

Incremental detokenisation follows vLLM's ``detokenize_incrementally``: decode a short window of tokens twice (with
and without the newest ones) and emit the difference, unless the window ends in U+FFFD, which means a multi-byte UTF-8
character is not complete yet; those bytes wait for the next chunk. Its cost does not grow with the length of the
output (a window starts at most a few tokens back). With a fast (Rust) tokenizer the same algorithm runs inside
``tokenizers``' ``DecodeStream``, one call per token, as vLLM's ``FastIncrementalDetokenizer`` does: 1.3 us a token
against 3.3 us for the two decodes per token in Python (tiny-llama's tokenizer, 12,800 random tokens; the texts are
the same, checked by tests/unit/frontend/test_frontend_detokenizer.py against transformers' own decode).

With a byte-level tokenizer (GPT-2's scheme: Llama 3, Qwen, tiny-llama) the stream needs no tokenizer call at all: a
token's text is a fixed byte string (its characters mapped back through GPT-2's byte table), and ``DecodeStream``'s
rule reduces to "append the token's bytes; emit their UTF-8 decoding once it does not end in U+FFFD". A table of each
token's bytes, built and checked against the Rust decoder at load, gives the same text chunk for chunk at ~0.2 us a
token against ~0.6 us for ``DecodeStream.step`` (tiny-llama, 2-core dev VM; docs/frontend.md, "eighth session").

Encoding calls the Rust tokenizer directly too, when it gives what transformers' ``encode`` gives (checked on a
probe text at load): transformers wraps it in a batch of one plus padding and truncation set-up (~40 us of the
~430 us a 1,240-character chat prompt costs).

Imports no HTTP and no mesh client; ``transformers`` only inside ``load_tokenizer``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from components.frontend.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# tokenizers raises this (a plain Exception) when a decode is not an extension of the previous one, which some
# tokenizers' invalid UTF-8 output can cause; vLLM starts a fresh stream then, and so does this module.
_INVALID_PREFIX = "Invalid prefix encountered"
# Text the direct encoder must encode as transformers does before it is used: special tokens, spaces, a multi-byte
# character and an invalid surrogate-free mix of scripts.
_ENCODE_PROBE = "<|bos|> Hello,  wörld!\n\tDone. 日本 🙂 <s></s>[INST] x"

_REPLACEMENT = "\ufffd"
# A byte table is built for vocabularies up to this size (~5 MB of bytes objects at 256k tokens), checked token by
# token against the Rust decoder at load (~0.3 s for 128k tokens, in the loading thread).
_MAX_BYTE_TABLE = 1 << 18


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted (``tokenizers``' ByteLevel ``CHAR_BYTES``): printable character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def byte_table(backend: Any) -> list[bytes] | None:
    """Each token id's bytes as a ``ByteLevel``-decoding Rust tokenizer decodes it with ``skip_special_tokens``
    (special tokens: no bytes), or None where the tokenizer does not decode that way.

    ByteLevel's decoder maps every character of every token back to its byte (a token with a character outside the
    alphabet, such as an added token's, stays its own UTF-8) and decodes the concatenation with invalid sequences
    replaced: a token's bytes do not depend on its neighbours. That is checked here rather than assumed: every
    token alone, and random sequences (so that a character split over tokens, and added tokens between others,
    decode as the concatenation does), must give exactly what the Rust decoder gives; any difference: None.
    """
    from tokenizers import decoders  # imported after the tokenizer has loaded, as DecodeStream below

    if not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()
    n = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    if n > _MAX_BYTE_TABLE:
        return None
    chars = _byte_level_chars()
    table: list[bytes] = []
    for i in range(n):
        tok = backend.id_to_token(i)
        if tok is None or (i in added and added[i].special):
            table.append(b"")
            continue
        try:
            table.append(bytes([chars[c] for c in tok]))
        except KeyError:
            table.append(tok.encode())
    decode = backend.decode
    if any(table[i].decode("utf-8", "replace") != decode([i], skip_special_tokens=True) for i in range(n)):
        return None
    rng = random.Random(0)
    for _ in range(64):
        ids = [rng.randrange(n) for _ in range(rng.randrange(2, 24))]
        if b"".join([table[i] for i in ids]).decode("utf-8", "replace") != decode(ids, skip_special_tokens=True):
            return None
    return table


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
        self._backend = backend
        if backend is not None and not getattr(hf, "clean_up_tokenization_spaces", False):
            self._backend_decode = backend.decode
        else:
            self._backend_decode = None
        # The Rust encoder straight away, when it encodes the probe as transformers does with and without special
        # tokens (a tokenizer class that adds its own Python steps, such as a legacy prefix-space rule, does not).
        self._backend_encode = None
        self._backend_encode_fast: Any = None
        if backend is not None:
            try:
                same = all(
                    list(hf.encode(_ENCODE_PROBE, add_special_tokens=s))
                    == backend.encode(_ENCODE_PROBE, add_special_tokens=s).ids
                    for s in (True, False)
                )
            except Exception as e:  # noqa: BLE001 - any failure of the probe just keeps transformers' path
                logger.debug("direct encoder of %s not used: %r", path, e)
                same = False
            if same:
                self._backend_encode = backend.encode
                # tokenizers >= 0.21: the same ids without the character offsets ``encode`` also computes, which
                # are half its cost (a 1,240-token chat prompt: ~220 us against ~450 us of process CPU).
                fast = getattr(backend, "encode_batch_fast", None)
                try:
                    if fast is not None and all(
                        fast([_ENCODE_PROBE], add_special_tokens=s)[0].ids
                        == backend.encode(_ENCODE_PROBE, add_special_tokens=s).ids
                        for s in (True, False)
                    ):
                        self._backend_encode_fast = fast
                except Exception as e:  # noqa: BLE001 - as above: the plain direct encoder then
                    logger.debug("offset-free encoder of %s not used: %r", path, e)
        # Incremental detokenising in Rust where the decode above is the Rust one (same text, same special tokens).
        try:  # tokenizers >= 0.21, which transformers' fast tokenizers bring; imported here, after the heavy load
            from tokenizers.decoders import DecodeStream

            self._decode_stream: Any = DecodeStream
        except ImportError:  # pragma: no cover
            self._decode_stream = None
        self.streams_in_rust = self._decode_stream is not None and self._backend_decode is not None
        # Each token's bytes, where the stream can be decoded from them without the tokenizer (module docstring).
        self.byte_table: list[bytes] | None = None
        if self._backend_decode is not None:
            try:
                self.byte_table = byte_table(backend)
            except Exception as e:  # noqa: BLE001 - an unexpected tokenizer keeps the Rust stream
                logger.debug("byte table of %s not used: %r", path, e)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        fast = self._backend_encode_fast
        if fast is not None:
            ids: list[int] = fast([text], add_special_tokens=add_special_tokens)[0].ids
            return ids
        if self._backend_encode is not None:
            direct: list[int] = self._backend_encode(text, add_special_tokens=add_special_tokens).ids
            return direct
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode_stream(self, context: Sequence[int]) -> Any:
        """A ``tokenizers`` ``DecodeStream`` primed with ``context`` (``streams_in_rust`` only)."""
        return self._decode_stream(ids=list(context) or None, skip_special_tokens=True)

    def stream_step(self, stream: Any, token_id: int) -> str | None:
        """One token through ``stream``: its new text, or None while it completes nothing (a partial character)."""
        try:
            out: str | None = stream.step(self._backend, token_id)
            return out
        except (OverflowError, TypeError):  # a token id the tokenizer cannot take: it has no text
            logger.debug("token id %r cannot be decoded", token_id)
            return None

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


# The ``tokenizer_class`` names (tokenizer_config.json) that ``AutoTokenizer`` resolves to transformers' generic fast
# tokenizer (``PreTrainedTokenizerFast`` is an alias of ``TokenizersBackend`` in transformers 5): Llama 3's, Mistral's
# and most tokenizers saved from ``tokenizers`` name it.
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def tokenizer_class_name(path: str) -> str | None:
    """The ``tokenizer_class`` a model directory's tokenizer_config.json names, or None (no file, unreadable, not a
    string)."""
    import json
    import os

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from a local directory (blocking: call it in a thread). Never reaches for a hub.

    A directory whose tokenizer_config.json names the generic fast tokenizer (``_GENERIC_FAST``) and has its
    tokenizer.json is loaded by that class directly: the class ``AutoTokenizer`` picks for it, without importing
    ``AutoTokenizer``, which imports the model configuration classes and through them torch (~2.7 s of a ~4.4 s load on
    the 2-core dev VM; every frontend process paid it at start-up, and torch is never used here). Any other tokenizer
    (a model-specific class, none named, no tokenizer.json) goes through ``AutoTokenizer`` as before."""
    import os

    if tokenizer_class_name(path) in _GENERIC_FAST and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # no torch import

        hf: Any = TokenizersBackend.from_pretrained(path, local_files_only=True)
    else:
        from transformers import AutoTokenizer  # heavy (~4 s with torch): imported only when a model first appears

        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Tokenizer(hf, path)


class IncrementalDetokenizer:
    """Output token ids -> text, chunk by chunk, never emitting half a UTF-8 character."""

    __slots__ = (
        "_decode",
        "_ids",
        "_pending",
        "_prefix_offset",
        "_read_offset",
        "_step",
        "_stream",
        "_table",
        "_tokenizer",
    )

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = tokenizer.decode
        self._tokenizer = tokenizer
        self._stream: Any = None
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0
        # Byte-level: the bytes of the tokens since the last text emitted (a character not complete yet, or invalid
        # bytes not followed by a valid character). The prompt is no context here: ByteLevel drops no leading space.
        self._pending = b""
        self._table = tokenizer.byte_table
        if self._table is not None:
            return
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        # A token-id prompt may end inside a character; such a context would swallow the first output bytes.
        if context and _REPLACEMENT in self._decode(context):
            context = []
        if tokenizer.streams_in_rust:
            self._stream = tokenizer.decode_stream(context)
            self._step = tokenizer.stream_step
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def feed(self, token_ids: Sequence[int]) -> str:
        """Text that ``token_ids`` complete; may be empty (an unfinished character, a special token)."""
        table = self._table
        if table is not None:
            if len(token_ids) != 1:  # token by token, as DecodeStream emits: "é" then a lone lead byte gives "é"
                return "".join([self.feed((t,)) for t in token_ids])
            t = token_ids[0]
            try:
                # An id the tokenizer has no token for decodes to nothing (tokenizers skips it; the Rust stream
                # returns None for one it cannot take at all).
                data = table[t] if t >= 0 else b""
            except (IndexError, TypeError):
                data = b""
            if self._pending:
                data = self._pending + data
            elif not data:
                return ""
            text = data.decode("utf-8", "replace")
            if text.endswith(_REPLACEMENT):  # DecodeStream's rule: wait for the bytes that complete it
                self._pending = data
                return ""
            self._pending = b""
            return text
        stream = self._stream
        if stream is not None:
            if len(token_ids) == 1:
                try:
                    return self._step(stream, token_ids[0]) or ""
                except Exception as e:  # noqa: BLE001 - _restart re-raises all but tokenizers' invalid prefix
                    return self._restart(e, token_ids[0])
            out = []
            for t in token_ids:
                try:
                    piece = self._step(stream, t)
                except Exception as e:  # noqa: BLE001 - as above
                    piece = self._restart(e, t)
                if piece:
                    out.append(piece)
            return "".join(out)
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def _restart(self, e: Exception, token_id: int) -> str:
        """vLLM's recovery from a decode that is not an extension of the previous one: a fresh stream from here."""
        if not str(e).startswith(_INVALID_PREFIX):
            raise e
        logger.warning("detokeniser: %s; restarting it at token %d", e, token_id)
        self._stream = self._tokenizer.decode_stream(())
        return self._step(self._stream, token_id) or ""

    def flush(self) -> str:
        """At the end of the output: whatever is left, less the replacement characters an incomplete UTF-8 character
        at the very end decodes to (the output stopped inside it: vLLM's server sends nothing for those bytes either;
        a replacement character inside the text, an invalid byte the model really produced, is kept). A Rust stream
        (and the byte table) has nothing else left: it holds back only tokens whose text ends in a replacement
        character."""
        if self._stream is not None or self._table is not None:
            return ""
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
