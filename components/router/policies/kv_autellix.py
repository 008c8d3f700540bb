"""``kv+autellix``: Autellix's program affinity where it applies, KV-aware placement everywhere else.

A request over ``locality_threshold_tokens`` with a program id goes to its program's worker (a locality hit), exactly
as in ``autellix``. Everything that policy would send to LEAST_USED (short requests, long ones without a program id,
a program's first long request, a reassignment) is placed by ``kv.choose`` instead: busy workers skipped, the
imbalance override, then the lowest predicted time to first token (``kv``'s cost). A program's first long
request therefore lands where its prefix (a shared system prompt, an earlier program's context) is already cached,
and stays there.

Parameters (``RouterConfig``): those of ``autellix`` (``locality_threshold_tokens``, ``program_ttl_s``) and of ``kv``
(``decode_weight``, ``router_temperature``, the busy and balance thresholds). The state is ``AutellixState``.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import autellix, kv
from components.router.types import DecisionKind, Reason, RouteDecision, RouteRequest, WorkerSnapshot


class KvAutellixPolicy:
    name = "kv+autellix"
    uses_kv = True
    uses_inflight = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def initial_state(self) -> autellix.AutellixState:
        return autellix.AutellixState()

    def end_program(self, state: autellix.AutellixState, program_id: str) -> autellix.AutellixState:
        return autellix.end_program(state, program_id)

    def select(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerSnapshot],
        state: autellix.AutellixState,
        rng: random.Random,
    ) -> tuple[RouteDecision, autellix.AutellixState]:
        config = self.config

        def kv_choose(cands: Sequence[WorkerSnapshot]) -> tuple[WorkerSnapshot, Reason, int, DecisionKind]:
            return kv.choose(request, cands, config, rng)

        return autellix.place(request, workers, state, config, kv_choose, label="kv+autellix")
