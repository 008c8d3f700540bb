"""A measured engine profile: prefill time against prompt length and decode step time against batch size and KV
tokens, interpolated, with the analytic model (``model.StepTimeModel``) fitted to it by least squares.

``kvmesh profile`` (components/workers/profiling.py measures, components/cli/profile.py is the command) writes one as
JSON; a worker started with ``--profile PATH`` announces its fitted coefficients (``WorkerMetadata.step_time``) and
``profile_id``, so the router's fast path predicts with this engine's numbers.

What is stored, for each grid point, from repeated measurements (warm-up excluded by the measurer): the median, the
least and the most of the repeats, and how many there were (``Point``).

* prefill: one step that computes ``n`` prompt tokens, for ``n`` in ``prompt_tokens`` (ascending). Between grid points
  the median is interpolated linearly (piecewise-linear in ``n``); ``prefill_ms(0)`` is 0.
* decode: one step that decodes ``b`` sequences of ``c`` context tokens each, ``b`` in ``batch_sizes`` and ``c`` in
  ``context_tokens`` (both ascending): a rectangular grid in (batch size, mean context per sequence), interpolated
  bilinearly. ``decode_ms(b, kv_tokens)`` reads it at ``c = kv_tokens / b``: the KV tokens in the batch over its size.
  A grid in (batch, total KV tokens) would not be rectangular, since a measurement fixes ``b`` and ``c``.
* beyond the grid: the value at the nearest edge (the query clamped into the grid) plus what the fitted analytic
  model adds from there to the query: ``f(x) = f(clamp(x)) + fit(x) - fit(clamp(x))``, floored at 0. The fit is
  quadratic in ``n`` for prefill and linear in ``b`` and ``b * c`` for decode, so extrapolation keeps the measured
  level at the edge and the model's slope (and curvature) beyond it, rather than a flat line (which would call a
  32k-token prompt as cheap as the largest measured) or the last segment's slope (which bends with one noisy point).
* the fit: non-negative weighted least squares of the model's three prefill coefficients on the prefill medians,
  and of its three decode coefficients on the decode medians, weighted by 1 / median so that every point counts by
  its relative error (a 20 ms and a 200 ms step alike); ``fit_error`` reports the relative error of the fit at the
  grid points (root mean square and largest) for each part. Coefficients are kept non-negative because a worker
  announces them and ``StepTimeModel.from_mapping`` refuses negative ones (solved exactly over every subset of free
  coefficients: 8 small systems).

This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeGuard, runtime_checkable

from .errors import ProfileFormatError
from .model import DEFAULT_MODEL, StepTimeModel

__all__ = [
    "FORMAT",
    "PerfModel",
    "Point",
    "Profile",
    "fit_decode",
    "fit_prefill",
    "interp_1d",
    "nnls",
]

FORMAT = "kvmesh-profile"
VERSION = 1


@runtime_checkable
class PerfModel(Protocol):
    """What a planner or simulator asks of an engine's performance, answered by the analytic ``StepTimeModel`` and
    by a measured ``Profile`` alike (times in ms)."""

    @property
    def max_num_batched_tokens(self) -> int: ...

    def prefill_ms(self, n: int) -> float:
        """One step computing ``n`` prompt tokens; 0 for none."""
        ...

    def decode_ms(self, seqs: int, kv_tokens: float) -> float:
        """One step decoding ``seqs`` sequences attending to ``kv_tokens`` KV tokens in all; 0 for none."""
        ...

    def step_ms(self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int) -> float:
        """A step of either kind or both."""
        ...

    def chunked_prefill_ms(self, n: int) -> float:
        """A prompt of ``n`` tokens alone on an idle engine, in chunks of ``max_num_batched_tokens``."""
        ...


@dataclasses.dataclass(slots=True, frozen=True)
class Point:
    """One grid point's repeated measurements, summarised: median, least, most (ms) and how many."""

    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Point:
        if not samples_ms:
            raise ValueError("a grid point needs at least one measurement")
        return cls(
            float(statistics.median(samples_ms)), float(min(samples_ms)), float(max(samples_ms)), len(samples_ms)
        )

    @property
    def spread(self) -> float:
        """(most - least) / median: how much the repeats disagree."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms > 0 else 0.0


def interp_1d(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation of ``ys`` over ascending ``xs``, ``x`` clamped into ``[xs[0], xs[-1]]``."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + t * (ys[hi] - ys[lo])


def _bracket(xs: Sequence[float], x: float) -> tuple[int, int, float]:
    """Indices around ``x`` (clamped into the grid) and its share of the way from the first to the second."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    hi = next(i for i, v in enumerate(xs) if v > x)
    lo = hi - 1
    return lo, hi, (x - xs[lo]) / (xs[hi] - xs[lo])


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Non-negative weighted least squares ``min sum w_i^2 (row_i . x - y_i)^2, x >= 0`` for a few unknowns, solved
    exactly: the unconstrained solution over every subset of free unknowns (the others 0), the best feasible one.
    Columns are scaled to unit largest magnitude first (``n**2`` reaches ~1e8 beside a column of ones)."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[w * r[j] / scale[j] for j in range(k)] for r, w in zip(rows, weights, strict=True)]
    yw = [w * y for y, w in zip(ys, weights, strict=True)]
    best, best_sse = [0.0] * k, sum(v * v for v in yw)
    for size in range(1, k + 1):
        for free in itertools.combinations(range(k), size):
            ata = [[sum(r[i] * r[j] for r in a) for j in free] for i in free]
            aty = [sum(r[i] * y for r, y in zip(a, yw, strict=True)) for i in free]
            sol = _solve(ata, aty)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * k
            for i, v in zip(free, sol, strict=True):
                x[i] = v
            sse = sum((sum(r[j] * x[j] for j in range(k)) - y) ** 2 for r, y in zip(a, yw, strict=True))
            if sse < best_sse - 1e-15 * max(1.0, best_sse):
                best, best_sse = x, sse
    return [v / scale[j] for j, v in enumerate(best)]


def fit_prefill(prompt_tokens: Sequence[int], median_ms: Sequence[float]) -> tuple[float, float, float]:
    """``(prefill_base_ms, prefill_ms_per_token, prefill_ms_per_token_sq)`` fitted to the prefill medians."""
    rows = [[1.0, float(n), float(n) * n] for n in prompt_tokens]
    base, per, sq = nnls(rows, median_ms, [1.0 / y if y > 0 else 1.0 for y in median_ms])
    return base, per, sq


def fit_decode(
    batch_sizes: Sequence[int], context_tokens: Sequence[float], median_ms: Sequence[Sequence[float]]
) -> tuple[float, float, float]:
    """``(decode_base_ms, decode_ms_per_seq, decode_ms_per_kv_token)`` fitted to the decode medians."""
    rows, ys = [], []
    for i, b in enumerate(batch_sizes):
        for j, c in enumerate(context_tokens):
            rows.append([1.0, float(b), float(b) * c])
            ys.append(median_ms[i][j])
    base, per_seq, per_kv = nnls(rows, ys, [1.0 / y if y > 0 else 1.0 for y in ys])
    return base, per_seq, per_kv


def _rel_errors(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    rel = [abs(f - m) / m for f, m in pairs if m > 0]
    if not rel:
        return {"rel_rms": 0.0, "rel_max": 0.0}
    return {"rel_rms": math.sqrt(sum(e * e for e in rel) / len(rel)), "rel_max": max(rel)}


@dataclasses.dataclass(frozen=True)
class Profile:
    """A measured profile (module docstring). Build one with ``Profile.build``; read one with ``Profile.load``."""

    prompt_tokens: tuple[int, ...]
    prefill: tuple[Point, ...]
    batch_sizes: tuple[int, ...]
    context_tokens: tuple[float, ...]
    decode: tuple[tuple[Point, ...], ...]  # decode[i][j]: batch_sizes[i], context_tokens[j]
    max_num_batched_tokens: int
    fit: StepTimeModel
    fit_error: Mapping[str, float]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    # --- building ----------------------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        *,
        prompt_tokens: Sequence[int],
        prefill_samples_ms: Sequence[Sequence[float]],
        batch_sizes: Sequence[int],
        context_tokens: Sequence[float],
        decode_samples_ms: Sequence[Sequence[Sequence[float]]],
        max_num_batched_tokens: int,
        host_load_ms_per_token: float = DEFAULT_MODEL.host_load_ms_per_token,
        meta: Mapping[str, Any] | None = None,
    ) -> Profile:
        """From raw repeats: ``prefill_samples_ms[i]`` at ``prompt_tokens[i]``, ``decode_samples_ms[i][j]`` at
        ``batch_sizes[i]`` x ``context_tokens[j]``; fits the analytic model and measures the fit's error."""
        prefill = tuple(Point.of(s) for s in prefill_samples_ms)
        decode = tuple(tuple(Point.of(s) for s in row) for row in decode_samples_ms)
        return cls.from_points(
            prompt_tokens=prompt_tokens,
            prefill=prefill,
            batch_sizes=batch_sizes,
            context_tokens=context_tokens,
            decode=decode,
            max_num_batched_tokens=max_num_batched_tokens,
            host_load_ms_per_token=host_load_ms_per_token,
            meta=meta,
        )

    @classmethod
    def from_points(
        cls,
        *,
        prompt_tokens: Sequence[int],
        prefill: Sequence[Point],
        batch_sizes: Sequence[int],
        context_tokens: Sequence[float],
        decode: Sequence[Sequence[Point]],
        max_num_batched_tokens: int,
        host_load_ms_per_token: float = DEFAULT_MODEL.host_load_ms_per_token,
        meta: Mapping[str, Any] | None = None,
    ) -> Profile:
        _check_grid("prompt_tokens", prompt_tokens, len(prefill))
        _check_grid("batch_sizes", batch_sizes, len(decode))
        for i, row in enumerate(decode):
            _check_grid("context_tokens", context_tokens, len(row), f"decode row {i}")
        pm = [p.median_ms for p in prefill]
        dm = [[p.median_ms for p in row] for row in decode]
        pb, pt, psq = fit_prefill(prompt_tokens, pm)
        db, ds, dk = fit_decode(batch_sizes, context_tokens, dm)
        fit = StepTimeModel(
            prefill_base_ms=pb,
            prefill_ms_per_token=pt,
            prefill_ms_per_token_sq=psq,
            decode_base_ms=db,
            decode_ms_per_seq=ds,
            decode_ms_per_kv_token=dk,
            max_num_batched_tokens=int(max_num_batched_tokens),
            host_load_ms_per_token=host_load_ms_per_token,
        )
        pe = _rel_errors([(fit.prefill_ms(n), m) for n, m in zip(prompt_tokens, pm, strict=True)])
        de = _rel_errors(
            [
                (fit.decode_ms(b, b * c), dm[i][j])
                for i, b in enumerate(batch_sizes)
                for j, c in enumerate(context_tokens)
            ]
        )
        error = {
            "prefill_rel_rms": pe["rel_rms"],
            "prefill_rel_max": pe["rel_max"],
            "decode_rel_rms": de["rel_rms"],
            "decode_rel_max": de["rel_max"],
        }
        return cls(
            prompt_tokens=tuple(int(n) for n in prompt_tokens),
            prefill=tuple(prefill),
            batch_sizes=tuple(int(b) for b in batch_sizes),
            context_tokens=tuple(float(c) for c in context_tokens),
            decode=tuple(tuple(row) for row in decode),
            max_num_batched_tokens=int(max_num_batched_tokens),
            fit=fit,
            fit_error=error,
            meta=dict(meta or {}),
        )

    # --- predicting (PerfModel) -------------------------------------------------------------------------------------

    def prefill_ms(self, n: int) -> float:
        if n <= 0:
            return 0.0
        xs = self.prompt_tokens
        ys = [p.median_ms for p in self.prefill]
        edge = min(max(n, xs[0]), xs[-1])
        v = interp_1d(xs, ys, edge)
        if edge != n:
            v += self.fit.prefill_ms(n) - self.fit.prefill_ms(edge)
        return max(0.0, v)

    def decode_ms(self, seqs: int, kv_tokens: float) -> float:
        if seqs <= 0:
            return 0.0
        bs, cs = self.batch_sizes, self.context_tokens
        c = kv_tokens / seqs
        i0, i1, tb = _bracket(bs, seqs)
        j0, j1, tc = _bracket(cs, c)
        g = self.decode
        v0 = g[i0][j0].median_ms + tc * (g[i0][j1].median_ms - g[i0][j0].median_ms)
        v1 = g[i1][j0].median_ms + tc * (g[i1][j1].median_ms - g[i1][j0].median_ms)
        v = v0 + tb * (v1 - v0)
        b_edge = min(max(seqs, bs[0]), bs[-1])
        c_edge = min(max(c, cs[0]), cs[-1])
        if b_edge != seqs or c_edge != c:
            v += self.fit.decode_ms(seqs, kv_tokens) - self.fit.decode_ms(b_edge, b_edge * c_edge)
        return max(0.0, v)

    def step_ms(self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int) -> float:
        return self.prefill_ms(num_prefill_tokens) + self.decode_ms(num_decode_seqs, num_decode_kv_tokens)

    def chunked_prefill_ms(self, n: int) -> float:
        full, rest = divmod(max(1, n), self.max_num_batched_tokens)
        return full * self.prefill_ms(self.max_num_batched_tokens) + self.prefill_ms(rest)

    # --- identity and the announcement --------------------------------------------------------------------------------

    @property
    def profile_id(self) -> str:
        """``sha256:`` and 16 hex digits of the measurements (grids and points, not ``meta``): two files with the
        same numbers have the same id, whatever they are called."""
        d = self.to_dict()
        body = json.dumps({"prefill": d["prefill"], "decode": d["decode"], "budget": d["max_num_batched_tokens"]})
        return "sha256:" + hashlib.sha256(body.encode()).hexdigest()[:16]

    def step_time(self) -> dict[str, float]:
        """What a worker running the profiled engine announces (``WorkerMetadata.step_time``): the fitted model."""
        return self.fit.to_mapping()

    # --- JSON -------------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def points(ps: Sequence[Point]) -> dict[str, list[Any]]:
            return {
                "median_ms": [p.median_ms for p in ps],
                "min_ms": [p.min_ms for p in ps],
                "max_ms": [p.max_ms for p in ps],
                "repeats": [p.repeats for p in ps],
            }

        rows = [points(row) for row in self.decode]
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": dict(self.meta),
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefill": {"prompt_tokens": list(self.prompt_tokens), **points(self.prefill)},
            "decode": {
                "batch_sizes": list(self.batch_sizes),
                "context_tokens": list(self.context_tokens),
                **{k: [r[k] for r in rows] for k in ("median_ms", "min_ms", "max_ms", "repeats")},
            },
            "fit": self.fit.to_mapping(),
            "fit_error": dict(self.fit_error),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: Any, source: str = "") -> Profile:
        """From ``to_dict``'s shape; ``ProfileFormatError`` naming the first bad field otherwise. The fit is
        recomputed from the stored medians (deterministic), and must match the stored one: a hand-edited
        coefficient that the measurements do not give is refused rather than announced."""

        def bad(where: str, why: str) -> ProfileFormatError:
            return ProfileFormatError(where, why, source)

        if not isinstance(d, Mapping):
            raise bad("(top level)", f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise bad("format", f"expected {FORMAT!r}, got {d.get('format')!r}")
        if d.get("version") != VERSION:
            raise bad("version", f"expected {VERSION}, got {d.get('version')!r}")
        budget = d.get("max_num_batched_tokens")
        if not _is_int(budget) or budget < 1:
            raise bad("max_num_batched_tokens", f"expected a positive integer, got {budget!r}")
        pre, dec = d.get("prefill"), d.get("decode")
        if not isinstance(pre, Mapping):
            raise bad("prefill", "expected an object")
        if not isinstance(dec, Mapping):
            raise bad("decode", "expected an object")
        xs = _numbers(pre.get("prompt_tokens"), "prefill.prompt_tokens", bad, integer=True)
        prefill = _points(pre, "prefill", len(xs), bad)
        bs = _numbers(dec.get("batch_sizes"), "decode.batch_sizes", bad, integer=True)
        cs = _numbers(dec.get("context_tokens"), "decode.context_tokens", bad)
        medians = dec.get("median_ms")
        if not isinstance(medians, list) or len(medians) != len(bs):
            raise bad("decode.median_ms", f"expected {len(bs)} rows (one per batch size)")
        decode = []
        for i in range(len(bs)):
            row = {k: (dec.get(k) or [None] * len(bs))[i] for k in ("median_ms", "min_ms", "max_ms", "repeats")}
            decode.append(_points(row, f"decode[{i}]", len(cs), bad))
        for name, axis in (("prefill.prompt_tokens", xs), ("decode.batch_sizes", bs), ("decode.context_tokens", cs)):
            if any(b <= a for a, b in itertools.pairwise(axis)):
                raise bad(name, "must be strictly ascending")
            if axis[0] <= 0:
                raise bad(name, "must be positive")
        meta = d.get("meta", {})
        if not isinstance(meta, Mapping):
            raise bad("meta", "expected an object")
        fit_in = d.get("fit", {})
        host = fit_in.get("host_load_ms_per_token") if isinstance(fit_in, Mapping) else None
        out = cls.from_points(
            prompt_tokens=[int(x) for x in xs],
            prefill=prefill,
            batch_sizes=[int(b) for b in bs],
            context_tokens=cs,
            decode=decode,
            max_num_batched_tokens=int(budget),
            host_load_ms_per_token=float(host)
            if _is_number(host) and host >= 0
            else DEFAULT_MODEL.host_load_ms_per_token,
            meta=meta,
        )
        if isinstance(fit_in, Mapping) and fit_in:
            for k, v in out.fit.to_mapping().items():
                got = fit_in.get(k)
                if not _is_number(got) or not math.isclose(got, v, rel_tol=1e-6, abs_tol=1e-12):
                    raise bad(f"fit.{k}", f"{got!r} is not what the measurements give ({v!r})")
        return out

    @classmethod
    def from_json(cls, text: str, source: str = "") -> Profile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileFormatError("(file)", f"not JSON: {e}", source) from e
        return cls.from_dict(d, source)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(Path(path).read_text(encoding="utf-8"), str(path))


def _is_number(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _numbers(v: Any, where: str, bad: Any, integer: bool = False) -> list[float]:
    if not isinstance(v, list) or not v:
        raise bad(where, "expected a non-empty list of numbers")
    for k, x in enumerate(v):
        if not (_is_int(x) if integer else _is_number(x)):
            raise bad(f"{where}[{k}]", f"expected {'an integer' if integer else 'a number'}, got {x!r}")
    return [float(x) for x in v]


def _points(d: Mapping[str, Any], where: str, n: int, bad: Any) -> list[Point]:
    cols = {}
    for k in ("median_ms", "min_ms", "max_ms", "repeats"):
        col = d.get(k)
        if not isinstance(col, list) or len(col) != n:
            raise bad(f"{where}.{k}", f"expected a list of {n} (one per grid point)")
        for i, x in enumerate(col):
            ok = (_is_int(x) and x >= 1) if k == "repeats" else (_is_number(x) and x >= 0)
            if not ok:
                raise bad(f"{where}.{k}[{i}]", f"expected a {'positive integer' if k == 'repeats' else 'number >= 0'}")
        cols[k] = col
    out = []
    for i in range(n):
        lo, med, hi = cols["min_ms"][i], cols["median_ms"][i], cols["max_ms"][i]
        if not lo <= med <= hi:
            raise bad(f"{where}[{i}]", f"needs min_ms <= median_ms <= max_ms, got {lo}, {med}, {hi}")
        out.append(Point(float(med), float(lo), float(hi), int(cols["repeats"][i])))
    return out


def _check_grid(name: str, axis: Sequence[float], n: int, where: str = "") -> None:
    if not axis or len(axis) != n:
        raise ValueError(f"{where or name}: {n} points for a grid of {len(axis)} {name}")
    if any(b <= a for a, b in itertools.pairwise(axis)) or axis[0] <= 0:
        raise ValueError(f"{name} must be positive and strictly ascending, got {list(axis)}")
