"""What the load generator sends and when: trace readers, the Mooncake token expansion, synthetic prompts, the
replay schedule. No I/O beyond reading the trace file; no asyncio.

Formats (``/work/shared/traces/README.md``):
* **Mooncake** jsonl: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``. Each hash id stands for
  one 512-token block of the prompt; equal ids are equal blocks (a shared prefix). A row becomes a token-id prompt:
  block ``h`` is 512 pseudo-random ids seeded by ``(seed, h)``, the row's blocks are concatenated and the last one is
  cut so the prompt has exactly ``input_length`` tokens. Sent to ``/v1/completions`` (``prompt`` as a list of ints).
* **Azure** csv: ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``), ``ContextTokens``, ``GeneratedTokens``. A row becomes
  a synthetic token-id prompt of ``ContextTokens`` ids seeded by ``(seed, row)``: no two rows share a prefix, as the
  trace carries no prefix information. Timestamps count from the file's first row.
* **ShareGPT** json: a list of ``{"conversations": [{"from": "human", "value": text}, ...]}``. The first human turn's
  text is sent to ``/v1/chat/completions``; the file has no timestamps nor output lengths (``max_tokens`` applies).

Readers are lazy generators, so ``--max-requests 100`` on a 12k-row trace reads about 100 rows. They assume the
file is in timestamp order (both public traces are); the selected rows are sorted again before a replay.
"""

from __future__ import annotations

import csv
import json
import random
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import count, islice
from pathlib import Path

from .config import LoadConfig
from .errors import TraceFormatError

MOONCAKE_BLOCK_TOKENS = 512
# Distinct blocks kept expanded. Mooncake's conversation trace has 183k distinct hash ids but a prefix is shared by
# turns close in time, so a small LRU hits; 4096 lists of 512 small ints (cached int objects) are about 17 MB.
MOONCAKE_BLOCK_CACHE = 4096
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a workload, before it is turned into a prompt (prompts are built only when sent)."""

    index: int  # position in the file (0-based); seeds the row's synthetic prompt
    timestamp_s: float | None = None  # arrival in trace time; None: the file has no timestamps
    input_length: int | None = None  # prompt tokens; None for text prompts
    output_length: int | None = None  # max_tokens; None: the config's max_tokens
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks
    text: str | None = None  # ShareGPT prompt text


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


# --- Readers ----------------------------------------------------------------------------------------------------------


def detect_format(path: str | Path) -> str:
    """'mooncake', 'azure' or 'sharegpt', from the file's first bytes (not its name)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096)
    stripped = head.lstrip()
    if stripped.startswith("["):
        return "sharegpt"
    if stripped.startswith("{"):
        first = stripped.split("\n", 1)[0]
        try:
            row = json.loads(first)
        except json.JSONDecodeError as e:
            raise TraceFormatError(str(path), f"first line is not a JSON object: {e}", 1) from e
        if isinstance(row, dict) and "hash_ids" in row:
            return "mooncake"
        raise TraceFormatError(str(path), f"a JSON line without 'hash_ids' is no known trace; keys: {sorted(row)}", 1)
    header = [c.strip() for c in stripped.split("\n", 1)[0].split(",")]
    if all(c in header for c in AZURE_COLUMNS):
        return "azure"
    raise TraceFormatError(
        str(path),
        "unknown trace format: expected Mooncake jsonl, an Azure csv with columns "
        f"{', '.join(AZURE_COLUMNS)}, or a ShareGPT json list; pass --trace-format to force one",
    )


def read_mooncake(path: str | Path) -> Iterator[TraceRow]:
    with open(path, encoding="utf-8") as f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                row = TraceRow(
                    index=index,
                    timestamp_s=float(d["timestamp"]) / 1000.0,
                    input_length=int(d["input_length"]),
                    output_length=int(d["output_length"]),
                    hash_ids=tuple(int(h) for h in d["hash_ids"]),
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceFormatError(str(path), f"bad Mooncake row ({type(e).__name__}: {e})", lineno) from e
            if row.input_length is not None and row.input_length > MOONCAKE_BLOCK_TOKENS * len(row.hash_ids):
                raise TraceFormatError(
                    str(path),
                    f"input_length {row.input_length} is longer than its {len(row.hash_ids)} blocks of "
                    f"{MOONCAKE_BLOCK_TOKENS} tokens",
                    lineno,
                )
            yield row
            index += 1


def _azure_time(s: str) -> datetime:
    # Python 3.11's fromisoformat reads the trace's 7 fractional digits (it keeps 6: microseconds).
    return datetime.fromisoformat(s.strip())


def read_azure(path: str | Path) -> Iterator[TraceRow]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(str(path), f"missing column(s) {missing}; header: {reader.fieldnames}", 1)
        t0: datetime | None = None
        for index, d in enumerate(reader):
            try:
                t = _azure_time(d["TIMESTAMP"])
                t0 = t if t0 is None else t0
                row = TraceRow(
                    index=index,
                    timestamp_s=(t - t0).total_seconds(),
                    input_length=int(d["ContextTokens"]),
                    output_length=int(d["GeneratedTokens"]),
                )
            except (TypeError, ValueError) as e:
                raise TraceFormatError(str(path), f"bad Azure row ({e})", reader.line_num) from e
            yield row


def read_sharegpt(path: str | Path) -> Iterator[TraceRow]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(str(path), f"not JSON: {e}") from e
    if not isinstance(data, list):
        raise TraceFormatError(str(path), "a ShareGPT file is a JSON list of conversations")
    index = 0
    for entry in data:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        text = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
        if not isinstance(text, str) or not text.strip():
            continue  # a conversation without a human turn has nothing to send
        yield TraceRow(index=index, text=text)
        index += 1


READERS = {"mooncake": read_mooncake, "azure": read_azure, "sharegpt": read_sharegpt}


def read_trace(path: str | Path, fmt: str = "auto") -> Iterator[TraceRow]:
    if not Path(path).is_file():
        raise TraceFormatError(str(path), "no such file")
    if fmt == "auto":
        fmt = detect_format(path)
    return READERS[fmt](path)


def synthetic_rows(prompt_tokens: int, max_tokens: int) -> Iterator[TraceRow]:
    """An endless stream of synthetic requests (bounded by the caller): distinct prompts, no timestamps."""
    for i in count():
        yield TraceRow(index=i, input_length=prompt_tokens, output_length=max_tokens)


# --- Prompts ----------------------------------------------------------------------------------------------------------


def token_ids(key: str, n: int, vocab_size: int) -> list[int]:
    """``n`` pseudo-random ids in [0, vocab_size), a pure function of ``key`` (str seeds hash with SHA-512, so this
    does not depend on PYTHONHASHSEED). 32 random bits per id: the modulo bias is below vocab_size / 2**32."""
    raw = random.Random(key).randbytes(4 * n)
    return [x % vocab_size for x in struct.unpack(f"<{n}I", raw)]


class MooncakeBlocks:
    """Expands Mooncake hash ids into token blocks: equal ids (and seeds) give equal blocks, hence equal prefixes."""

    def __init__(self, vocab_size: int, seed: int = 0, max_cached: int = MOONCAKE_BLOCK_CACHE) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_cached = max_cached
        self._cache: OrderedDict[int, list[int]] = OrderedDict()

    def block(self, hash_id: int) -> list[int]:
        b = self._cache.get(hash_id)
        if b is not None:
            self._cache.move_to_end(hash_id)
            return b
        b = token_ids(f"{self.seed}:mooncake:{hash_id}", MOONCAKE_BLOCK_TOKENS, self.vocab_size)
        self._cache[hash_id] = b
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return b

    def prompt(self, hash_ids: Iterable[int], input_length: int) -> list[int]:
        """The concatenated blocks, the last one cut so that the prompt has exactly ``input_length`` tokens."""
        out: list[int] = []
        for h in hash_ids:
            if len(out) >= input_length:
                break
            out += self.block(h)
        if len(out) < input_length:
            raise ValueError(f"{input_length} tokens asked of blocks that hold {len(out)}")
        del out[input_length:]
        return out


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
