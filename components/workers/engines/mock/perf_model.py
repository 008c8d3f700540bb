"""How long one simulated engine step takes, and how long delivering KV blocks to another worker takes: the models
described (with their sources) in ``config.py``.

Pure arithmetic over a step's shape or a transfer's size; imports only the engine's config.
"""

from __future__ import annotations

from .config import MockEngineConfig

__all__ = ["step_time_ms", "transfer_time_s"]


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


def transfer_time_s(num_blocks: int, *, bytes_per_block: int, bandwidth_gbps: float, latency_ms: float) -> float:
    """Modelled duration of one KV transfer of ``num_blocks`` blocks, in seconds: ``latency_ms`` once plus the bytes
    at ``bandwidth_gbps`` (gigabits, 1e9 bit/s). 0 for no blocks: nothing is sent, so no transfer happens.

    With a config: ``transfer_time_s(n, bytes_per_block=c.kv_bytes_per_block, bandwidth_gbps=
    c.kv_transfer_bandwidth_gbps, latency_ms=c.kv_transfer_latency_ms)``.
    """
    if num_blocks < 0:
        raise ValueError(f"num_blocks cannot be negative (got {num_blocks})")
    if num_blocks == 0:
        return 0.0
    if bandwidth_gbps <= 0:
        raise ValueError(f"bandwidth_gbps must be positive (got {bandwidth_gbps})")
    return latency_ms / 1e3 + num_blocks * bytes_per_block * 8 / (bandwidth_gbps * 1e9)
