"""Workloads for the fleet simulator (``kvmesh bench routing``): a public trace file, or a synthetic prefix-sharing
shape, turned into ``Workload`` (token-id prompts, output lengths, arrival times, program ids).

Traces (format detected from the file's first bytes, as ``kvmesh bench load`` reads them):

* **Mooncake** jsonl: each hash id becomes one 512-token block of pseudo-random ids seeded by the id (equal ids,
  equal prefixes), the last block cut to ``input_length``; ``output_length`` and the timestamps as given. Program
  (conversation) ids are derived from the hash ids alone (``analysis.derive_programs``): nothing is assumed about
  which block is a system prompt or a conversation id, so any file of this format works without settings.
* **Azure** csv: ``ContextTokens`` distinct pseudo-random ids per row (the trace has no prefix information, so no two
  prompts share one), ``GeneratedTokens``, the timestamps as given.
* **ShareGPT** json: the first human turn's UTF-8 bytes as token ids (a byte-level vocabulary: equal texts, equal
  prompts; the file's texts barely share prefixes), ``output_tokens`` each (the file has no answers), Poisson
  arrivals (the file has no timestamps; only the shape matters, as the sweep rescales the rate).

Synthetic shapes (``SHAPES``), seeded, lengths drawn from log-normal distributions around stated medians, Poisson
arrivals unless said otherwise; each is a prefix-sharing pattern the public traces do not isolate:

* ``system_prompts``: many short shared system prompts (64 of them, median 600 tokens, Zipf(1.1) popularity), each
  request one of them plus its own user text (median 400 tokens); outputs median 200.
* ``documents``: few long shared documents (8, median 12,000 tokens, Zipf(1.1)), each request a document plus a
  question (median 100 tokens); outputs median 150.
* ``conversations``: multi-turn chats (each 2 to 12 turns); a turn's prompt is the whole history (earlier prompts
  and answers) plus a new user message (median 300 tokens); outputs median 250; the next turn arrives after the
  answer plus a think time (exponential, mean 20 s at the nominal rate); conversations start as a Poisson process.

Each shape has a ``scale``: its shared working set is ``scale`` times the base shape's, the shape otherwise the same.
``system_prompts`` and ``documents`` get ``scale`` times as many shared prefixes (same lengths, same Zipf law over
them); ``conversations`` get ``scale`` times as many conversations alive at once (think times ``scale`` times
longer, starts as frequent: a conversation's history waits longer while more others come and go). At scale 1 each
shape's working set fits in one worker's KV cache many times over (``kvmesh bench routing`` measures and reports it).

Nothing here does I/O beyond reading the trace file.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from pathlib import Path

from .analysis import derive_programs
from .traces import MooncakeBlocks, TraceRow, read_trace, token_ids
from .workload import SimRequest, Workload

SHAREGPT_OUTPUT_TOKENS = 256
SHAPES = ("system_prompts", "documents", "conversations")


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    population = list(range(n))
    return lambda: rng.choices(population, weights)[0]


def from_trace(
    path: str | Path,
    max_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    fmt: str = "auto",
    output_tokens: int = SHAREGPT_OUTPUT_TOKENS,
    min_prompt_tokens: int = 0,
    start_offset_s: float = 0.0,
    skip_rows: int = 0,
) -> Workload:
    """The first ``max_requests`` rows of a trace file as a workload (module docstring); with ``min_prompt_tokens``,
    the first that many rows whose prompt has at least that many tokens (a ShareGPT text: its UTF-8 bytes), the
    others skipped (their prompts are not built, and the kept rows' prompts are the ones they get unfiltered); with
    ``start_offset_s``, rows before that trace time are skipped too (the load generator's ``start_offset_s``: rows
    without a timestamp never are); with ``skip_rows``, the first that many rows that would have been kept are
    skipped (a later slice of the trace: ``kvmesh bench routing --slices``)."""
    rows = []
    skipped = 0
    for row in read_trace(path, fmt):
        if min_prompt_tokens > 0 and _prompt_length(row) < min_prompt_tokens:
            continue
        if row.timestamp_s is not None and row.timestamp_s < start_offset_s:
            continue
        if skipped < skip_rows:
            skipped += 1
            continue
        rows.append(row)
        if len(rows) >= max_requests:
            break
    if not rows:
        raise ValueError(f"{path}: no requests")
    name = Path(path).stem
    rng = random.Random(f"{seed}:arrivals:{name}")
    blocks = MooncakeBlocks(vocab_size, seed)
    programs = derive_programs([r.hash_ids for r in rows]) if any(r.hash_ids for r in rows) else [None] * len(rows)
    out: list[SimRequest] = []
    t = 0.0
    for row, program in zip(rows, programs, strict=True):
        if row.text is not None:
            prompt = tuple(min(b, vocab_size - 1) for b in row.text.encode("utf-8"))
            max_tokens = output_tokens
        else:
            n = max(1, row.input_length or 1)
            prompt = tuple(
                blocks.prompt(row.hash_ids, n)
                if row.hash_ids
                else token_ids(f"{seed}:{name}:{row.index}", n, vocab_size)
            )
            max_tokens = max(1, row.output_length or output_tokens)
        if row.timestamp_s is None:
            t += rng.expovariate(1.0)
            arrival = t
        else:
            arrival = row.timestamp_s
        out.append(SimRequest(arrival, prompt, max_tokens, program))
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    return Workload(name, tuple(SimRequest(r.arrival_s - t0, r.prompt, r.max_tokens, r.program_id) for r in out))


def count_rows(path: str | Path, fmt: str = "auto") -> int:
    """How many rows a trace file has (what ``from_trace``'s ``skip_rows`` is read against)."""
    return sum(1 for _ in read_trace(path, fmt))


def _prompt_length(row: TraceRow) -> int:
    return len(row.text.encode("utf-8")) if row.text is not None else max(1, row.input_length or 1)


@dataclasses.dataclass(frozen=True)
class ShapeParams:
    """The parameters of a synthetic shape; ``None`` fields take the base shape's (``base_params``). The defaults are
    the shapes the ``kv`` cost's constants were tuned on; ``draw_params`` gives others for a held-out set."""

    shared_count: int | None = None  # system_prompts/documents: shared prefixes (times ``scale``)
    shared_median: int | None = None  # their median length in tokens
    zipf_s: float | None = None  # their popularity law's exponent
    own_median: int | None = None  # each request's own text after the prefix (conversations: each user message)
    out_median: int | None = None  # outputs
    max_turns: int | None = None  # conversations: 2..max_turns turns each
    think_s: float | None = None  # conversations: mean think time between turns at scale 1

    def resolved(self, shape: str) -> ShapeParams:
        base = base_params(shape)
        return ShapeParams(**{
            f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
            for f in dataclasses.fields(self)
        })  # fmt: skip


def base_params(shape: str) -> ShapeParams:
    """The base shapes' parameters (module docstring)."""
    if shape == "system_prompts":
        return ShapeParams(64, 600, 1.1, 400, 200)
    if shape == "documents":
        return ShapeParams(8, 12000, 1.1, 100, 150)
    if shape == "conversations":
        return ShapeParams(own_median=300, out_median=250, max_turns=12, think_s=20.0)
    raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_params(shape: str, rng: random.Random) -> ShapeParams:
    """Parameters of ``shape`` drawn at random around the base shape's, for workloads the ``kv`` cost was never tuned
    on: the number and length of the shared prefixes, their popularity, and the share of new text per request
    (log-uniform over a range about 4x either side of the base; conversations: their turns, message and answer
    lengths and think times)."""
    if shape == "system_prompts":
        return ShapeParams(
            shared_count=round(_loguniform(rng, 16, 256)), shared_median=round(_loguniform(rng, 200, 2000)),
            zipf_s=round(rng.uniform(0.6, 1.4), 2), own_median=round(_loguniform(rng, 100, 1600)),
            out_median=round(_loguniform(rng, 64, 500)),
        )  # fmt: skip
    if shape == "documents":
        return ShapeParams(
            shared_count=round(_loguniform(rng, 3, 32)), shared_median=round(_loguniform(rng, 3000, 24000)),
            zipf_s=round(rng.uniform(0.6, 1.4), 2), own_median=round(_loguniform(rng, 30, 400)),
            out_median=round(_loguniform(rng, 50, 400)),
        )  # fmt: skip
    if shape == "conversations":
        return ShapeParams(
            own_median=round(_loguniform(rng, 80, 1200)), out_median=round(_loguniform(rng, 80, 800)),
            max_turns=rng.randint(3, 20), think_s=round(_loguniform(rng, 5, 60), 1),
        )  # fmt: skip
    raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")


def synthetic(
    shape: str,
    n: int,
    *,
    vocab_size: int,
    seed: int = 0,
    scale: float = 1.0,
    params: ShapeParams | None = None,
    name: str | None = None,
) -> Workload:
    """``n`` requests of a synthetic prefix-sharing shape at ``scale`` (module docstring), at a nominal 1 request/s.
    Named ``synthetic_<shape>``, with ``_x<scale>`` when the scale is not 1 (or ``name``). ``params``: other
    parameters than the base shape's (``ShapeParams``; the base shape's requests are the same with or without)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    p = (params or ShapeParams()).resolved(shape)
    if name is None:
        name = f"synthetic_{shape}" if scale == 1 else f"synthetic_{shape}_x{scale:g}"
    rng = random.Random(f"{seed}:{shape}" if scale == 1 else f"{seed}:{shape}:x{scale:g}")

    def ids(key: str, k: int) -> tuple[int, ...]:
        return tuple(token_ids(f"{seed}:{shape}:{key}", k, vocab_size))

    reqs: list[SimRequest] = []
    if shape in ("system_prompts", "documents"):
        assert p.shared_count and p.shared_median and p.zipf_s and p.own_median and p.out_median
        count, median, s = p.shared_count, p.shared_median, p.zipf_s
        count = max(1, round(count * scale))
        shared = [ids(f"shared{k}", _lognormal(rng, median, 0.4, median // 4, median * 3)) for k in range(count)]
        pick = _zipf_picker(rng, count, s)
        own_median, out_median = p.own_median, p.out_median
        t = 0.0
        for i in range(n):
            k = pick()
            prompt = shared[k] + ids(f"own{i}", _lognormal(rng, own_median, 0.6, 8, own_median * 8))
            # Independent requests (different users of one shared prefix are no program): no program id.
            reqs.append(SimRequest(t, prompt, _lognormal(rng, out_median, 0.6, 8, out_median * 6)))
            t += rng.expovariate(1.0)
        return Workload(name, tuple(reqs))
    # conversations: start times Poisson at a rate that, with their turns, makes about 1 request/s
    assert p.own_median and p.out_median and p.max_turns and p.think_s
    mean_turns = (2 + p.max_turns) / 2  # the mean of randint(2, max_turns): 7 for the base shape
    think_s = p.think_s * scale
    t_start = 0.0
    c = 0
    while len(reqs) < n:
        turns = rng.randint(2, p.max_turns)
        history: tuple[int, ...] = ()
        t = t_start
        for j in range(turns):
            prompt = history + ids(f"c{c}u{j}", _lognormal(rng, p.own_median, 0.6, 8, p.own_median * 8))
            out = _lognormal(rng, p.out_median, 0.6, 8, p.out_median * 6)
            reqs.append(SimRequest(t, prompt, out, f"c{c}"))
            history = prompt + ids(f"c{c}a{j}", out)  # the answer joins the history (its ids as the model's tokens)
            t += out * 0.02 + rng.expovariate(1.0 / think_s)
        c += 1
        t_start += rng.expovariate(1.0 / mean_turns)
    reqs.sort(key=lambda r: r.arrival_s)
    reqs = reqs[:n]
    return Workload(name, tuple(reqs))


# Llumnix's setting (``kvmesh bench rescheduling``): independent requests whose outputs are mostly short with a few
# very long ones, so that a worker that drew several long ones fills its KV cache (and preempts) while its
# neighbours idle: the imbalance its migration was built for (Llumnix's paper, OSDI '24, mixes short and long
# generation lengths with long tails for this reason). Not one of ``SHAPES``: ``kvmesh bench routing``'s defaults
# stay what they were.
SHORT_LONG_LONG_FRACTION = 0.1  # one request in ten is a long one
SHORT_LONG_PROMPT_MEDIAN = 512
SHORT_LONG_SHORT_OUTPUT_MEDIAN = 64
SHORT_LONG_LONG_OUTPUT_MEDIAN = 2048
SHORT_LONG_LONG_OUTPUT_MAX = 6144


def short_long_mix(n: int, *, vocab_size: int, seed: int = 0) -> Workload:
    """``n`` independent requests at a nominal 1 request/s (Poisson): prompts log-normal around 512 tokens (sigma
    0.6, 16 to 4,096), outputs short (log-normal around 64, sigma 0.6, 4 to 512) with probability 0.9, else very long
    (log-normal around 2,048, sigma 0.4, 512 to 6,144); no shared prefixes (each prompt its own ids). Named
    ``llumnix_short_long``."""
    rng = random.Random(f"{seed}:short_long")
    reqs: list[SimRequest] = []
    t = 0.0
    for i in range(n):
        prompt = tuple(token_ids(f"{seed}:short_long:p{i}", _lognormal(rng, SHORT_LONG_PROMPT_MEDIAN, 0.6, 16, 4096),
                                 vocab_size))  # fmt: skip
        if rng.random() < SHORT_LONG_LONG_FRACTION:
            out = _lognormal(rng, SHORT_LONG_LONG_OUTPUT_MEDIAN, 0.4, 512, SHORT_LONG_LONG_OUTPUT_MAX)
        else:
            out = _lognormal(rng, SHORT_LONG_SHORT_OUTPUT_MEDIAN, 0.6, 4, 512)
        reqs.append(SimRequest(t, prompt, out))
        t += rng.expovariate(1.0)
    return Workload("llumnix_short_long", tuple(reqs))
