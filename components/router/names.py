"""The routing policies' registered names and their aliases, as plain data.

Both ``config.py`` (to validate ``--router-policy``) and ``policies/__init__.py`` (the registry of implementations)
read this module, so neither imports the other: the registry's keys are checked against ``POLICY_NAMES`` by
tests/unit/router/test_router_config.py. Imports nothing.
"""

POLICY_NAMES = ("round_robin", "random", "power_of_two", "least_loaded", "autellix", "kv", "kv+autellix", "kv_dynamo")

# Spellings of the systems these come from: Dynamo's ``--router-mode`` values, Autellix's ``least_used`` (its
# LEAST_USED), and ``kv_autellix`` for places that do not allow a ``+`` (graph files name the policy with
# ``[A-Za-z0-9_-]``).
ALIASES: dict[str, str] = {
    "round-robin": "round_robin",
    "power-of-two": "power_of_two",
    "least-loaded": "least_loaded",
    "least_used": "least_loaded",
    "kv_autellix": "kv+autellix",
}


def canonical_name(name: str) -> str:
    """The registered name for ``name`` or one of its aliases; unknown names are returned as they are."""
    return ALIASES.get(name, name)
