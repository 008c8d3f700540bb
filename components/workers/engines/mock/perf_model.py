"""How long one simulated engine step takes, and how long delivering KV blocks to another worker takes: the engine's
view of ``components.perf.model`` (the one copy of the formula and its defaults), with its coefficients read from
the engine's config.
"""

from __future__ import annotations

from components.perf.model import transfer_time_s

from .config import MockEngineConfig

__all__ = ["step_time_ms", "transfer_time_s"]


def step_time_ms(
    config: MockEngineConfig, *, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int
) -> float:
    """Modelled duration of one step in ms (``StepTimeModel.step_ms`` with ``config``'s coefficients); 0 for an
    empty step.

    ``num_prefill_tokens``: prompt (or recomputed) tokens computed this step, over all prefilling sequences.
    ``num_decode_seqs``: sequences producing their next token from one new token. ``num_decode_kv_tokens``: KV
    tokens those sequences attend to, summed (each attends to its whole context).
    """
    return config.step_time_model.step_ms(num_prefill_tokens, num_decode_seqs, num_decode_kv_tokens)
