"""Routing policies by readable name. Each module is pure: it imports only the standard library and
``components.router``'s ``types``/``config`` (checked by tests/unit/test_layering.py).

| name           | module             | places a request on                                                       |
|----------------|--------------------|---------------------------------------------------------------------------|
| ``round_robin``  | round_robin.py     | the next worker in instance-id order                                      |
| ``random``       | random_pick.py     | a uniformly random worker                                                 |
| ``power_of_two`` | power_of_two.py    | the less loaded of two random workers                                     |
| ``least_loaded`` | least_loaded.py    | the worker with the fewest requests (or prompt tokens) in flight          |
| ``autellix``     | autellix.py        | least loaded if short; its program's worker if long (Autellix Alg. 2)     |
| ``kv``           | kv.py              | the soonest predicted first token, given its cached prefix and its queue  |
| ``kv+autellix``  | kv_autellix.py     | its program's worker if long, else the lowest kv cost                     |
| ``kv_dynamo``    | kv.py              | Dynamo's cost: prefill blocks to compute + decode blocks in flight        |

Names and aliases live in ``components/router/names.py`` as plain data (``POLICY_NAMES``, ``ALIASES``): the
spellings of the systems these come from (Dynamo's ``--router-mode`` values, Autellix's ``least_used``) and
``kv_autellix`` for places that do not allow a ``+``.

Every policy reads its parameters from ``RouterConfig`` (its module docstring lists which) and every one shares the
rules of ``common.py``: pins, retries, stale workers.

To add a policy: write ``policies/<name>.py`` with a class that satisfies ``types.RoutingPolicy`` and takes a
``RouterConfig``, and register it below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from components.router.names import ALIASES, canonical_name
from components.router.policies.autellix import AutellixPolicy
from components.router.policies.kv import KvDynamoPolicy, KvPolicy
from components.router.policies.kv_autellix import KvAutellixPolicy
from components.router.policies.least_loaded import LeastLoadedPolicy
from components.router.policies.power_of_two import PowerOfTwoPolicy
from components.router.policies.random_pick import RandomPolicy
from components.router.policies.round_robin import RoundRobinPolicy

if TYPE_CHECKING:
    from components.router.config import RouterConfig
    from components.router.types import RoutingPolicy

POLICIES: dict[str, Callable[[RouterConfig], RoutingPolicy[Any]]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "least_loaded": LeastLoadedPolicy,
    "autellix": AutellixPolicy,
    "kv": KvPolicy,
    "kv+autellix": KvAutellixPolicy,
    "kv_dynamo": KvDynamoPolicy,
}

__all__ = ["ALIASES", "POLICIES", "canonical_name"]
