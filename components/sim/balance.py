"""How balanced a fleet's KV could be made by moving whole requests: floors for the KV-use imbalance a rescheduler is
judged on (``kvmesh bench rescheduling``'s ``kv_spread``: max minus min of the workers' KV use), computed on one
instant's holdings.

A rescheduler that moves requests, each whole with its KV, can at best re-place the requests a fleet holds at an
instant. Here: ``n`` workers, items (a request's blocks, or a group of requests that share blocks and move
together) placed whole, and blocks held by nothing movable either spread freely (``residual``: a lower bound treats
them as divisible) or left where they are (``preload``). The question asked of an instant is the smallest max - min
of the workers' blocks over every placement (``spread_bounds``): a lower bound that holds for every placement and
the best placement found, equal when the search finished (``exact``).

* ``spread_lower_bound``: the largest worker holds at least the largest item, at least the mean, and (pigeonhole) at
  least the two smallest of the ``n + 1`` largest items together; the smallest worker then holds at most what is left
  over the others, ``(T - M) / (n - 1)``. So any placement has max - min >= ``(n M - T) / (n - 1)``.
* ``spread_bounds``: longest-first greedy as the first placement, then a depth-first search over the items (largest
  first, equal-load workers tried once) pruned by the same bound; up to ``max_nodes`` placements tried.
* ``sharing_groups``: requests on one worker that share a block (transitively) move together if no block is to be
  duplicated; a group's size is the union of its blocks (what the worker counts, ``BlockPool.num_active_blocks``).
* ``lone_move_narrows``: whether one request of the fullest worker, moved to the emptiest, narrows their gap (a move
  of ``s`` blocks across a gap ``g`` leaves ``|g - 2 s|``: it narrows iff ``0 < s < g``).

Pure: the standard library only; no simulation (scripts/imbalance_floor.py feeds it a replay's instants).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

DEFAULT_MAX_NODES = 20_000


def _pour(loads: Sequence[float], residual: float) -> float:
    """max - min of ``loads`` after ``residual`` divisible blocks are poured into the emptiest workers first."""
    hi = max(loads)
    s = sorted(loads)
    left = residual
    for i in range(len(s)):
        # Raise the i + 1 emptiest workers from s[i] to the next level (or to hi).
        nxt = s[i + 1] if i + 1 < len(s) else hi
        need = (i + 1) * (nxt - s[i])
        if left < need or i + 1 == len(s):
            level = s[i] + left / (i + 1)
            return max(0.0, hi - level) if level < hi else 0.0
        left -= need
    return 0.0


def spread_lower_bound(items: Sequence[int], n: int, residual: float = 0.0) -> float:
    """A lower bound of max - min over every whole placement of ``items`` on ``n`` workers, ``residual`` divisible
    blocks besides (module docstring)."""
    if n <= 1 or not items:
        return 0.0
    s = sorted(items, reverse=True)
    total = sum(s) + residual
    biggest = max(s[0], total / n)
    if len(s) > n:
        biggest = max(biggest, s[n - 1] + s[n])
    return max(0.0, (n * biggest - total) / (n - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadBounds:
    lower: float  # no placement does better
    best: float  # a placement found
    exact: bool  # best == the optimum (lower reached, or the search finished)


def spread_bounds(
    items: Sequence[int],
    n: int,
    residual: float = 0.0,
    preload: Sequence[float] | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
    tolerance: float = 0.0,
) -> SpreadBounds:
    """The smallest max - min of the workers' blocks over whole placements of ``items`` on ``n`` workers, with
    ``residual`` divisible blocks poured in last and ``preload`` (per worker) fixed where it is. The search stops
    once a placement is within ``tolerance`` blocks of the lower bound (``exact`` then means: within it)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if preload is not None and len(preload) != n:
        raise ValueError(f"preload has {len(preload)} workers, expected {n}")
    base = [float(x) for x in preload] if preload is not None else [0.0] * n
    s = sorted((int(x) for x in items), reverse=True)
    lower = spread_lower_bound(s, n, residual) if preload is None else 0.0
    if n == 1:
        return SpreadBounds(0.0, 0.0, True)
    # Longest first onto the emptiest: the first placement.
    loads = list(base)
    for x in s:
        loads[min(range(n), key=loads.__getitem__)] += x
    best = _pour(loads, residual)
    tol = tolerance + 1e-9
    if best <= lower + tol:
        return SpreadBounds(lower, best, True)
    suffix = [0] * (len(s) + 1)
    for i in range(len(s) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + s[i]
    total = sum(base) + suffix[0] + residual
    nodes = 0
    loads = list(base)

    def dfs(i: int) -> bool:
        """False: out of nodes."""
        nonlocal best, nodes
        nodes += 1
        if nodes > max_nodes:
            return False
        if i == len(s):
            best = min(best, _pour(loads, residual))
            return True
        hi = max(loads)
        # The fullest worker holds at least hi at the end; the emptiest at most what is left over the others.
        if hi - (total - hi) / (n - 1) >= best - tol:
            return True
        # Or: the emptiest now can gain at most the rest; the spread is at least hi - (min + rest) after pouring.
        if hi - (min(loads) + suffix[i] + residual) >= best - tol:
            return True
        tried: set[float] = set()
        for w in sorted(range(n), key=loads.__getitem__):
            if loads[w] in tried:
                continue
            tried.add(loads[w])
            loads[w] += s[i]
            ok = dfs(i + 1)
            loads[w] -= s[i]
            if not ok:
                return False
            if best <= lower + tol:
                return True
        return True

    if dfs(0):  # every placement seen (up to the tolerance): best is the optimum, or within the tolerance of it
        return SpreadBounds(max(lower, best - tolerance), best, True)
    return SpreadBounds(lower, best, best <= lower + tol)


def sharing_groups(requests: Sequence[Sequence[Hashable]]) -> list[int]:
    """Sizes of the groups of ``requests`` (each a sequence of its block ids) that share a block, transitively: each
    group's size is the number of distinct blocks its requests hold."""
    parent = list(range(len(requests)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Hashable, int] = {}
    for i, blocks in enumerate(requests):
        for b in blocks:
            j = owner.setdefault(b, i)
            if j != i:
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[ri] = rj
    groups: dict[int, set[Hashable]] = {}
    for i, blocks in enumerate(requests):
        groups.setdefault(find(i), set()).update(blocks)
    return [len(g) for g in groups.values()]


def lone_move_narrows(sizes_on_fullest: Sequence[int], gap: float) -> bool:
    """Whether some request of the fullest worker (``sizes_on_fullest``, blocks), moved alone onto the emptiest,
    narrows their ``gap`` (blocks): ``0 < s < gap`` for one of them."""
    return any(0 < x < gap for x in sizes_on_fullest)
