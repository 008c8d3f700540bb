"""What the load generator sends and when: a trace's rows (read by ``components.sim.traces``) into requests, synthetic
prompts, the replay schedule. No I/O beyond reading the trace file; no asyncio.

A Mooncake row becomes a token-id prompt (``MooncakeBlocks``) sent to ``/v1/completions`` (``prompt`` as a list of
ints); an Azure row a synthetic token-id prompt of ``ContextTokens`` ids seeded by ``(seed, row)`` (no two rows share
a prefix); a ShareGPT row's text goes to ``/v1/chat/completions`` (``max_tokens`` applies). The selected rows are
sorted by time again before a replay.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from components.sim.traces import MooncakeBlocks, TraceRow, token_ids

from .config import LoadConfig


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as sent: a token-id prompt goes to /v1/completions, a text prompt to /v1/chat/completions."""

    index: int
    prompt: str | list[int]
    max_tokens: int
    user: str | None = None  # the OpenAI 'user' field: a conversation id for program-affinity routing

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, str)

    @property
    def prompt_tokens(self) -> int | None:
        """Known prompt length (token-id prompts); text prompts are counted by the server's usage."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def build_request(row: TraceRow, cfg: LoadConfig, blocks: MooncakeBlocks) -> RequestSpec:
    """The request a row stands for, with the config's caps applied (lengths are at least 1 token)."""
    max_tokens = max(1, row.output_length if row.output_length is not None else cfg.max_tokens)
    if cfg.max_output_tokens is not None:
        max_tokens = min(max_tokens, cfg.max_output_tokens)
    prompt: str | list[int]
    if row.text is not None:
        prompt = row.text
    else:
        n = max(1, row.input_length if row.input_length is not None else cfg.prompt_tokens)
        if cfg.max_input_tokens is not None:
            n = min(n, cfg.max_input_tokens)  # cutting the end keeps every shared prefix shared
        if row.hash_ids:
            prompt = blocks.prompt(row.hash_ids, n)
        else:
            prompt = synthetic_prompt(cfg, row.index, n)
    user = None
    k = cfg.program_id_block
    if k is not None and k < len(row.hash_ids):
        user = f"conv-{row.hash_ids[k]}"
    return RequestSpec(index=row.index, prompt=prompt, max_tokens=max_tokens, user=user)


def text(key: str, n: int) -> str:
    """``n`` characters of random lowercase words (about one space in six), a pure function of ``key``: ASCII only,
    so a byte-level tokenizer makes exactly one token of each character."""
    return random.Random(key).randbytes(n).translate(_TEXT_TABLE).decode("ascii")


# Byte -> character: 256 = 9 x 27 + 13, so the letters a-m come up 10/256, n-z and the space 9/256 each (the
# bias does not matter: the text only has to be varied and reproducible).
_TEXT_ALPHABET = b"abcdefghijklmnopqrstuvwxyz "
_TEXT_TABLE = bytes(_TEXT_ALPHABET[i % len(_TEXT_ALPHABET)] for i in range(256))


def synthetic_prompt(cfg: LoadConfig, index: int, n: int) -> str | list[int]:
    """Request ``index``'s synthetic prompt of ``n`` tokens (``cfg.synthetic_prompt``: token ids or text): one of
    ``cfg.num_shared_prefixes`` shared prefixes (picked at random, seeded by the request) then a unique rest."""
    shared = min(cfg.shared_prefix_tokens, n)
    prefix_key = ""
    if shared:
        pick = random.Random(f"{cfg.seed}:prefix-pick:{index}").randrange(cfg.num_shared_prefixes)
        prefix_key = f"{cfg.seed}:prefix:{pick}"
    own_key = f"{cfg.seed}:prompt:{index}"
    if cfg.synthetic_prompt == "text":
        return (text(prefix_key, shared) if shared else "") + text(own_key, n - shared)
    head = token_ids(prefix_key, shared, cfg.vocab_size) if shared else []
    return head + token_ids(own_key, n - shared, cfg.vocab_size)


# --- Schedule ---------------------------------------------------------------------------------------------------------


def select_rows(rows: Iterable[TraceRow], start_offset_s: float, max_requests: int) -> Iterator[TraceRow]:
    """Rows from trace time ``start_offset_s`` on, at most ``max_requests`` of them (rows without a timestamp are
    never skipped)."""
    kept = (r for r in rows if r.timestamp_s is None or r.timestamp_s >= start_offset_s)
    return islice(kept, max_requests)


def replay_schedule(
    rows: Iterable[TraceRow], start_offset_s: float, time_scale: float, max_requests: int, duration_s: float
) -> list[tuple[float, TraceRow]]:
    """(send time in seconds after the start of the run, row), sorted by send time.

    A row at trace time ``t`` is sent at ``(t - start_offset_s) * time_scale``; rows that would be sent at or after
    ``duration_s`` are dropped, and at most ``max_requests`` are kept.
    """
    out: list[tuple[float, TraceRow]] = []
    for row in rows:
        if row.timestamp_s is None:
            raise ValueError(f"row {row.index} has no timestamp: only a timestamped trace can be replayed")
        if row.timestamp_s < start_offset_s:
            continue
        send_at = (row.timestamp_s - start_offset_s) * time_scale
        if send_at >= duration_s:
            break  # the file is in time order: every later row would be sent later still
        out.append((send_at, row))
        if len(out) >= max_requests:
            break
    out.sort(key=lambda x: x[0])
    return out
