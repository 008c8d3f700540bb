"""The rescheduler's pure policies (STYLE.md habit 1): functions over ``InstanceView``s and the config, no I/O.

- ``common``: the load metric (projected KV use), "failing", the failure-domain fence, "healthy";
- ``load``: ``decode_load``, ``neutral_load``;
- ``failover``: ``prefill_failover``, ``decode_failover``, ``neutral_failover``;
- ``binpacking``: ``binpacking_mitigation``, ``binpacking_consolidation``;
- ``cycle``: ``plan_cycle``, every configured policy in order with the cycle's pair validation.

Imports: the standard library and components.rescheduler only (tests/unit/test_layering.py).
"""

from components.rescheduler.policies.common import projected_kv_use
from components.rescheduler.policies.cycle import POLICIES, plan_cycle

__all__ = ["POLICIES", "plan_cycle", "projected_kv_use"]
