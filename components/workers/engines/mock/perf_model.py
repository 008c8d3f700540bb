"""How long one simulated engine step takes: the polynomial described (with its sources) in ``config.py``.

Pure arithmetic over the step's shape; imports only the engine's config.
"""

from __future__ import annotations

from .config import MockEngineConfig

__all__ = ["step_time_ms"]


def step_time_ms(
    config: MockEngineConfig, *, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int
) -> float:
    """Modelled duration of one step in ms; 0 for an empty step.

    ``num_prefill_tokens``: prompt (or recomputed) tokens computed this step, over all prefilling sequences.
    ``num_decode_seqs``: sequences producing their next token from one new token. ``num_decode_kv_tokens``: KV
    tokens those sequences attend to, summed (each attends to its whole context).
    """
    ms = 0.0
    if num_prefill_tokens > 0:
        n = num_prefill_tokens
        ms += config.prefill_base_ms + config.prefill_ms_per_token * n + config.prefill_ms_per_token_sq * n * n
    if num_decode_seqs > 0:
        ms += (
            config.decode_base_ms
            + config.decode_ms_per_seq * num_decode_seqs
            + config.decode_ms_per_kv_token * num_decode_kv_tokens
        )
    return ms
