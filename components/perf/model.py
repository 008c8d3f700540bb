"""The analytic step-time model of the simulated engine, written once: what one engine step costs by its shape, how
long a KV transfer and a host-tier load take, and the default coefficients with where they come from.

The mock engine charges these times (``workers/engines/mock``), the router's ``kv`` cost predicts times to first
token with them (``router.types.StepTime`` is this model plus router-only helpers), and the fleet benchmarks' TTFT
floors are computed from them. A measured ``profile.Profile`` answers the same questions (``PerfModel``).

The model is ``step_ms = prefill_ms + decode_ms`` with

* ``prefill_ms = prefill_base_ms + prefill_ms_per_token * n + prefill_ms_per_token_sq * n**2`` when the step
  computes ``n > 0`` prompt tokens (a prefill chunk, or a recompute after preemption), else 0;
* ``decode_ms = decode_base_ms + decode_ms_per_seq * b + decode_ms_per_kv_token * k`` when the step decodes
  ``b > 0`` sequences that attend to ``k`` KV tokens in all, else 0;
* a step carries at most ``max_num_batched_tokens`` tokens, one per decoding sequence and the rest prefill.

Adding the two parts counts the fixed cost twice in a mixed step, where a real engine runs one forward pass; with the
defaults that overestimates a mixed step by ~5 ms out of ~40-200 ms, well inside how approximate these numbers are.

The defaults are the order of magnitude of Llama-3-8B (bf16) on one H100 and are approximate, not measured here:

* prefill: the polynomial Dynamo's mocker uses (``lib/mocker`` in ai-dynamo/dynamo:
  ``4.209989e-07 * n^2 + 1.518344e-02 * n + 1.650142e+01`` ms; the source does not say which model or GPU it was fit
  on). It gives 16.5 ms + 15 us/token, 170 ms for an 8192-token prompt, i.e. ~48k prompt tokens/s.
* decode, from first principles on an H100 SXM (3.35 TB/s HBM, ~990 TFLOP/s bf16 dense): reading 16 GB of weights
  once per step is ~4.8 ms, so the base is 5 ms (Dynamo's mocker: 5.74 ms at an empty cache); each sequence adds its
  MLP/projection FLOPs (2 * 8e9 = 16 GFLOP) at ~70% utilisation, ~0.02 ms; each attended KV token reads
  2 (K, V) * 32 layers * 8 KV heads * 128 dims * 2 bytes = 128 KiB, ~0.04 us at full bandwidth, 0.03 us taken here
  (Dynamo's mocker's decode curve, -25.74 p^2 + 54.01 p + 5.74 ms over 2^20 tokens, has a chord slope of 0.027 us).
  Example: 64 sequences of 2048 tokens: 5 + 1.3 + 3.9 = 10.2 ms per step, ~6300 output tokens/s.
* token budget, 8192: vLLM V1's OpenAI-server default ``max_num_batched_tokens`` on large-memory GPUs such as the H100.

KV transfer (disaggregated prefill: a prefill worker's blocks delivered to a decode worker) takes
``latency_ms + bytes / bandwidth`` (``transfer_time_s``), with ``kv_bytes_per_block`` = 2 (K and V) x layers x KV
heads x head dim x dtype bytes x block size. The model-shape defaults are Llama-3-8B's (its config.json: 32 layers,
8 KV heads, head dim 128; bf16 KV cache), the same model the step times describe: 128 KiB per token, 2 MiB per
16-token block.

* bandwidth, 400 Gb/s: one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU, as in a DGX H100 (8 GPUs, 8 ConnectX-7),
  the path an RDMA library (NIXL, as Dynamo uses) moves KV over between nodes. Taken at line rate: large RDMA
  writes reach over 90% of it (perftest's ib_write_bw), and the rest is well inside how approximate the step times
  are. NVLink within a node is ~10x faster (450 GB/s each way on an H100); set it for prefill and decode workers
  that share a node.
* latency, 1 ms per transfer: what does not depend on the size: the control messages that announce the blocks and
  their completion (a NATS round trip on a LAN is ~0.2-0.5 ms) and posting the RDMA writes (tens of us).
  Example: an 8192-token prompt is 512 blocks, 1 GiB: 1 ms + 1.07e9 B / 50e9 B/s = 22.5 ms, against the ~170 ms its
  prefill takes.

Host-memory KV tier (what vLLM's offloading connector, LMCache, Dynamo's KVBM and the Mooncake store add to an
engine): a request whose prefix continues in host memory past what the device caches loads those blocks back instead
of recomputing them, in the step that admits it: ``host latency + bytes / host bandwidth`` (``transfer_time_s``).

* bandwidth, 400 Gb/s (50 GB/s): an H100's host link is PCIe Gen5 x16, 64 GB/s each way; copies from pinned memory
  reach ~50-55 GB/s. An 8192-token prompt (1 GiB) loads in ~21 ms, about an eighth of its ~170 ms prefill.
* latency, 0.1 ms per load: what does not depend on the size (the lookup, launching the copies).
* per token, bandwidth only (what a router weighs a host hit by): 128 KiB * 8 / 400e9 b/s = 2.62144 us.

This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_MODEL",
    "HEAD_DIM",
    "HOST_KV_BANDWIDTH_GBPS",
    "HOST_KV_LATENCY_MS",
    "KV_CACHE_DTYPE_BYTES",
    "KV_TRANSFER_BANDWIDTH_GBPS",
    "KV_TRANSFER_LATENCY_MS",
    "NUM_HIDDEN_LAYERS",
    "NUM_KEY_VALUE_HEADS",
    "STEP_TIME_FIELDS",
    "StepTimeModel",
    "host_load_ms_per_token",
    "kv_bytes_per_block",
    "transfer_time_s",
]

# --- step-time coefficients (module docstring: Llama-3-8B bf16 on one H100) -----------------------------------------
PREFILL_BASE_MS = 16.5  # Dynamo mocker's 1.650142e+01, rounded
PREFILL_MS_PER_TOKEN = 1.518e-2  # its 1.518344e-02
PREFILL_MS_PER_TOKEN_SQ = 4.21e-7  # its 4.209989e-07
DECODE_BASE_MS = 5.0  # 16 GB of weights at 3.35 TB/s: ~4.8 ms
DECODE_MS_PER_SEQ = 0.02  # 16 GFLOP a sequence at ~70% of 990 TFLOP/s
DECODE_MS_PER_KV_TOKEN = 3e-5  # 128 KiB a KV token at 3.35 TB/s: ~0.04 us, 0.03 taken
MAX_NUM_BATCHED_TOKENS = 8192  # vLLM V1's default on large-memory GPUs

# --- model shape (Llama-3-8B's config.json) and the KV links -------------------------------------------------------
NUM_HIDDEN_LAYERS = 32
NUM_KEY_VALUE_HEADS = 8
HEAD_DIM = 128
KV_CACHE_DTYPE_BYTES = 2  # bf16
BLOCK_SIZE = 16  # vLLM's default on CUDA
KV_TRANSFER_BANDWIDTH_GBPS = 400.0  # one 400 Gb/s RDMA NIC per GPU
KV_TRANSFER_LATENCY_MS = 1.0  # control messages, posting the writes
HOST_KV_BANDWIDTH_GBPS = 400.0  # PCIe Gen5 x16 from pinned memory, ~50 GB/s
HOST_KV_LATENCY_MS = 0.1  # the lookup, launching the copies

# The fields of the step-time model, as a worker announces it (``WorkerMetadata.step_time``).
STEP_TIME_FIELDS = (
    "prefill_base_ms",
    "prefill_ms_per_token",
    "prefill_ms_per_token_sq",
    "decode_base_ms",
    "decode_ms_per_seq",
    "decode_ms_per_kv_token",
    "max_num_batched_tokens",
    "host_load_ms_per_token",
)


def kv_bytes_per_block(
    *,
    num_hidden_layers: int = NUM_HIDDEN_LAYERS,
    num_key_value_heads: int = NUM_KEY_VALUE_HEADS,
    head_dim: int = HEAD_DIM,
    kv_cache_dtype_bytes: int = KV_CACHE_DTYPE_BYTES,
    block_size: int = BLOCK_SIZE,
) -> int:
    """Bytes of one KV block: 2 (K and V) x layers x KV heads x head dim x dtype bytes x block size (2 MiB with the
    defaults)."""
    return 2 * num_hidden_layers * num_key_value_heads * head_dim * kv_cache_dtype_bytes * block_size


def host_load_ms_per_token(bytes_per_block: int, block_size: int, bandwidth_gbps: float) -> float:
    """ms per token to load KV from a host tier at ``bandwidth_gbps`` (bandwidth only, no fixed latency)."""
    return bytes_per_block / block_size * 8 / (bandwidth_gbps * 1e9) * 1e3


def transfer_time_s(num_blocks: int, *, bytes_per_block: int, bandwidth_gbps: float, latency_ms: float) -> float:
    """Modelled duration of one KV transfer (or host-tier load) of ``num_blocks`` blocks, in seconds: ``latency_ms``
    once plus the bytes at ``bandwidth_gbps`` (gigabits, 1e9 bit/s). 0 for no blocks: nothing is sent."""
    if num_blocks < 0:
        raise ValueError(f"num_blocks cannot be negative (got {num_blocks})")
    if num_blocks == 0:
        return 0.0
    if bandwidth_gbps <= 0:
        raise ValueError(f"bandwidth_gbps must be positive (got {bandwidth_gbps})")
    return latency_ms / 1e3 + num_blocks * bytes_per_block * 8 / (bandwidth_gbps * 1e9)


@dataclasses.dataclass(slots=True, frozen=True)
class StepTimeModel:
    """How long one engine step takes, in ms, by its shape (module docstring); the defaults are the simulated
    engine's. Frozen and hashable: the router keys cached rates by it."""

    prefill_base_ms: float = PREFILL_BASE_MS
    prefill_ms_per_token: float = PREFILL_MS_PER_TOKEN
    prefill_ms_per_token_sq: float = PREFILL_MS_PER_TOKEN_SQ
    decode_base_ms: float = DECODE_BASE_MS
    decode_ms_per_seq: float = DECODE_MS_PER_SEQ
    decode_ms_per_kv_token: float = DECODE_MS_PER_KV_TOKEN
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    host_load_ms_per_token: float = host_load_ms_per_token(kv_bytes_per_block(), BLOCK_SIZE, HOST_KV_BANDWIDTH_GBPS)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> StepTimeModel:
        """From a worker's ``step_time`` announcement; missing, negative or non-numeric fields keep their defaults."""
        if not d:
            return cls()
        kwargs: dict[str, Any] = {}
        for name in STEP_TIME_FIELDS:
            v = d.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
                kwargs[name] = int(v) if name == "max_num_batched_tokens" else float(v)
        if kwargs.get("max_num_batched_tokens", 1) < 1:
            del kwargs["max_num_batched_tokens"]
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, float]:
        """The announcement a worker running this model makes (``WorkerMetadata.step_time``)."""
        return {name: float(getattr(self, name)) for name in STEP_TIME_FIELDS}

    def prefill_ms(self, n: int) -> float:
        """A step that computes ``n`` prompt tokens (its prefill part); 0 for none."""
        return self.prefill_base_ms + self.prefill_ms_per_token * n + self.prefill_ms_per_token_sq * n * n if n else 0.0

    def decode_ms(self, seqs: int, kv_tokens: float) -> float:
        """A step that decodes ``seqs`` sequences attending to ``kv_tokens`` KV tokens in all (its decode part)."""
        if seqs <= 0:
            return 0.0
        return self.decode_base_ms + self.decode_ms_per_seq * seqs + self.decode_ms_per_kv_token * kv_tokens

    def step_ms(self, num_prefill_tokens: int, num_decode_seqs: int, num_decode_kv_tokens: int) -> float:
        """One step of either kind or both (a mixed step is the sum of the two parts); 0 for an empty step."""
        ms = 0.0
        if num_prefill_tokens > 0:
            ms += self.prefill_ms(num_prefill_tokens)
        if num_decode_seqs > 0:
            ms += self.decode_ms(num_decode_seqs, num_decode_kv_tokens)
        return ms

    def chunked_prefill_ms(self, n: int) -> float:
        """A prompt of ``n`` tokens alone on an idle engine: full chunks of ``max_num_batched_tokens``, then the
        rest; at least one token is computed (a fully cached prompt still computes its last)."""
        full, rest = divmod(max(1, n), self.max_num_batched_tokens)
        return full * self.prefill_ms(self.max_num_batched_tokens) + self.prefill_ms(rest)

    def host_load_ms(self, num_tokens: int) -> float:
        """Loading ``num_tokens`` tokens' KV from the host tier, bandwidth only (the router's weight of a host hit)."""
        return self.host_load_ms_per_token * num_tokens


DEFAULT_MODEL = StepTimeModel()
