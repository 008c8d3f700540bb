"""Trace files as rows: the readers of the public request traces and the Mooncake token expansion, shared by the
simulator (``components.sim.workloads``: rows into ``Workload``s) and the load generator (``kvmesh bench load``:
rows into requests sent to a server). No I/O beyond reading the trace file; no asyncio.

Formats (``/work/shared/traces/README.md``):
* **Mooncake** jsonl: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``. Each hash id stands for
  one 512-token block of the prompt; equal ids are equal blocks (a shared prefix). ``MooncakeBlocks`` turns a row's
  ids into a token-id prompt: block ``h`` is 512 pseudo-random ids seeded by ``(seed, h)``, the row's blocks are
  concatenated and the last one is cut so the prompt has exactly ``input_length`` tokens.
* **Azure** csv: ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``), ``ContextTokens``, ``GeneratedTokens``; timestamps
  count from the file's first row. The trace carries no prefix information.
* **ShareGPT** json: a list of ``{"conversations": [{"from": "human", "value": text}, ...]}``: the first human turn's
  text; the file has no timestamps nor output lengths.

Readers are lazy generators, so reading the first 100 rows of a 12k-row trace reads about 100 rows. They assume the
file is in timestamp order (the public traces are).
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
from itertools import count
from pathlib import Path

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
