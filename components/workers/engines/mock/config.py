"""Configuration of the simulated vLLM engine (``MockEngineConfig``): one pydantic model, every knob documented.

Names and defaults follow vLLM's engine arguments where vLLM has the knob (``num_gpu_blocks``, ``block_size``,
``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
``max_model_len``) and Dynamo's mocker where it does not (``speedup_ratio``).

The step-time model is ``step_ms = prefill_ms + decode_ms`` with

* ``prefill_ms = prefill_base_ms + prefill_ms_per_token * n + prefill_ms_per_token_sq * n**2`` when the step
  computes ``n > 0`` prompt tokens (a prefill chunk, or a recompute after preemption), else 0;
* ``decode_ms = decode_base_ms + decode_ms_per_seq * b + decode_ms_per_kv_token * k`` when the step decodes
  ``b > 0`` sequences that attend to ``k`` KV tokens in all, else 0.

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

KV transfer (disaggregated prefill: a prefill worker's blocks delivered to a decode worker) takes
``kv_transfer_latency_ms + bytes / bandwidth`` (``perf_model.transfer_time_s``), with ``kv_bytes_per_block`` =
2 (K and V) x ``num_hidden_layers`` x ``num_key_value_heads`` x ``head_dim`` x ``kv_cache_dtype_bytes`` x
``block_size``. The model-shape defaults are Llama-3-8B's (its config.json: 32 layers, 8 KV heads, head dim 128; bf16
KV cache), the same model the step times describe: 128 KiB per token, 2 MiB per 16-token block.

* bandwidth, 400 Gb/s: one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU, as in a DGX H100 (8 GPUs, 8 ConnectX-7),
  the path an RDMA library (NIXL, as Dynamo uses) moves KV over between nodes. Taken at line rate: large RDMA
  writes reach over 90% of it (perftest's ib_write_bw), and the rest is well inside how approximate the step times
  are. NVLink within a node is ~10x faster (450 GB/s each way on an H100); set it for prefill and decode workers
  that share a node.
* latency, 1 ms per transfer: what does not depend on the size: the control messages that announce the blocks and
  their completion (a NATS round trip on a LAN is ~0.2-0.5 ms) and posting the RDMA writes (tens of us).
  Example: an 8192-token prompt is 512 blocks, 1 GiB: 1 ms + 1.07e9 B / 50e9 B/s = 22.5 ms, against the ~170 ms its
  prefill takes.
Host-memory KV tier (``num_host_blocks``, off by default), what vLLM's offloading connector, LMCache, Dynamo's KVBM
and the Mooncake store add to an engine: every block that gets its hash on the device is also written to an LRU
cache of ``num_host_blocks`` blocks in host DRAM (write-through; the copy out runs beside the compute and is not
charged), and a request whose prefix continues in host memory past what the device caches loads those blocks back
instead of recomputing them, in the step that admits it: ``host_kv_latency_ms + bytes / host_kv_bandwidth_gbps``.
* bandwidth, 400 Gb/s (50 GB/s): an H100's host link is PCIe Gen5 x16, 64 GB/s each way; copies from pinned memory
  reach ~50-55 GB/s. An 8192-token prompt (1 GiB) loads in ~21 ms, about an eighth of its ~170 ms prefill.
* latency, 0.1 ms per load: what does not depend on the size (the lookup, launching the copies).
* size: a DGX H100 has 2 TiB of DRAM for 8 GPUs, 256 GiB each; half of it for KV is 128 GiB = 65,536 blocks of
  2 MiB, 4x the default device cache (``kvmesh bench routing``'s default).

This module imports only the standard library and pydantic.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The fields that make the step-time model, as a worker announces it (``WorkerMetadata.step_time``).
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


class MockEngineConfig(BaseModel):
    """Everything a simulated engine needs; a worker builds it from its CLI flags or graph YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- KV cache -------------------------------------------------------------------------------------------------
    num_gpu_blocks: int = Field(
        default=16384,
        ge=1,
        description="KV cache size in blocks; Dynamo's mocker's default count. 16384 x 16 tokens = 262144 tokens = "
        "32 GiB at Llama-3-8B's 128 KiB per token, somewhat less than the ~50 GiB an 80 GB H100 leaves for KV cache "
        "at 0.9 memory utilisation.",
    )
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block (vLLM's default on CUDA).")
    enable_prefix_caching: bool = Field(
        default=True,
        description="Keep full blocks, keyed by their chained hash, after their requests finish and reuse them for "
        "later requests with the same prefix. Off: no KV events are emitted at all.",
    )

    # --- Scheduler --------------------------------------------------------------------------------------------------
    max_num_seqs: int = Field(default=256, ge=1, description="Most running sequences (vLLM's long-standing default).")
    max_num_batched_tokens: int = Field(
        default=8192,
        ge=1,
        description="Token budget of one step: prefill chunk tokens plus one per decoding sequence (vLLM V1's "
        "OpenAI-server default on large-memory GPUs such as the H100).",
    )
    enable_chunked_prefill: bool = Field(
        default=True,
        description="Split a prompt longer than the remaining token budget over several steps. Off: a prompt is "
        "admitted only when it fits the step whole (then max_num_batched_tokens must be >= max_model_len).",
    )
    long_prefill_token_threshold: int = Field(
        default=0,
        ge=0,
        description="vLLM's long_prefill_token_threshold: while other requests are running or waiting, a prefill "
        "gets at most this many tokens per step, so one long prompt cannot fill a step that decoding sequences wait "
        "on (a disaggregated decode worker's local prefills, for example). 0: no cap (vLLM's default).",
    )
    max_model_len: int = Field(
        default=8192,
        ge=1,
        description="Most tokens (prompt + output) of one sequence; Llama-3-8B's context length. Longer prompts are "
        "rejected with EngineRequestError, and generation stops with finish_reason 'length' when it is reached.",
    )

    # --- Time -------------------------------------------------------------------------------------------------------
    speedup_ratio: float = Field(
        default=1.0,
        gt=0,
        description="Simulated time runs this many times faster than the wall clock: a step modelled at 20 ms sleeps "
        "20 / speedup_ratio ms. float('inf') (or the string 'inf') skips every sleep: each step only yields to the "
        "event loop, so hundreds of engines share one loop as fast as the CPU allows.",
    )
    prefill_base_ms: float = Field(
        default=16.5, ge=0, description="Fixed cost of a step that prefills any tokens, in ms."
    )
    prefill_ms_per_token: float = Field(default=1.518e-2, ge=0, description="Prefill cost per new prompt token, in ms.")
    prefill_ms_per_token_sq: float = Field(
        default=4.21e-7, ge=0, description="Prefill cost per new prompt token squared (attention), in ms."
    )
    decode_base_ms: float = Field(
        default=5.0, ge=0, description="Fixed cost of a step that decodes any sequence, in ms."
    )
    decode_ms_per_seq: float = Field(default=0.02, ge=0, description="Decode cost per sequence in the batch, in ms.")
    decode_ms_per_kv_token: float = Field(
        default=3e-5, ge=0, description="Decode cost per KV token attended (summed over the batch), in ms."
    )

    # --- Model shape and KV transfer (disaggregated prefill) --------------------------------------------------------
    num_hidden_layers: int = Field(
        default=32, ge=1, description="Transformer layers of the simulated model (Llama-3-8B: 32); sizes its KV blocks."
    )
    num_key_value_heads: int = Field(
        default=8, ge=1, description="KV heads per layer (Llama-3-8B: 8, grouped-query attention); sizes its KV blocks."
    )
    head_dim: int = Field(default=128, ge=1, description="Dimensions per attention head (Llama-3-8B: 128).")
    kv_cache_dtype_bytes: int = Field(
        default=2, ge=1, le=8, description="Bytes per KV cache element: 2 for bf16/fp16 (vLLM's auto), 1 for fp8."
    )
    kv_transfer_bandwidth_gbps: float = Field(
        default=400.0,
        gt=0,
        description="Bandwidth a KV transfer between a prefill and a decode worker gets, in gigabits per second "
        "(1e9 bit/s): one 400 Gb/s RDMA NIC per GPU. NVLink within a node: ~3600.",
    )
    kv_transfer_latency_ms: float = Field(
        default=1.0, ge=0, description="Fixed cost of one KV transfer, whatever its size, in ms (control messages)."
    )

    # --- Host-memory KV tier -----------------------------------------------------------------------------------------
    num_host_blocks: int = Field(
        default=0,
        ge=0,
        description="Blocks of the host-memory KV tier (LRU, written through from the device cache, loaded back on a "
        "prefix hit past the device's); 0: none. 65536 = 128 GiB at Llama-3-8B's 2 MiB per block, half a DGX H100 "
        "GPU's share of host DRAM.",
    )
    host_kv_bandwidth_gbps: float = Field(
        default=400.0,
        gt=0,
        description="Bandwidth of loading KV blocks from the host tier to the device, in gigabits per second: PCIe "
        "Gen5 x16 from pinned memory (~50 GB/s).",
    )
    host_kv_latency_ms: float = Field(
        default=0.1, ge=0, description="Fixed cost of one load from the host tier, whatever its size, in ms."
    )
    # --- Output tokens ----------------------------------------------------------------------------------------------
    vocab_size: int = Field(
        default=128256,
        ge=2,
        description="Output token ids are drawn from [0, vocab_size); prompt ids must lie there too (Llama-3).",
    )
    eos_token_id: int | None = Field(
        default=128009,
        ge=0,
        description="Generation stops ('stop') when this id is drawn, unless the request sets ignore_eos "
        "(Llama-3-Instruct's <|eot_id|>). With the default vocabulary a 1000-token answer ends early with "
        "probability 1 - (1 - 1/128256)^1000 = 0.8%. None: only max_tokens and stop_token_ids end a request.",
    )
    seed: int = Field(
        default=0,
        description="Mixed into every output token. Engines that share it produce identical tokens for identical "
        "requests, which tests of routing and migration rely on; give a fleet one seed.",
    )

    # --- Faults -----------------------------------------------------------------------------------------------------
    fail_after_s: float | None = Field(
        default=None,
        gt=0,
        description="Fault injection: the engine dies this many seconds after start(), as a crashed engine process "
        "would (every open request fails, dead_reason() says why); unset: never.",
    )

    # --- KV events --------------------------------------------------------------------------------------------------
    max_pending_kv_event_batches: int = Field(
        default=4096,
        ge=1,
        description="Batches of KV events buffered for a slow or absent kv_events() consumer; beyond it the oldest "
        "batch is dropped, the consumer sees a gap in event ids and resynchronises from kv_state().",
    )

    @property
    def is_infinitely_fast(self) -> bool:
        return math.isinf(self.speedup_ratio)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block: 2 (K and V) x layers x KV heads x head dim x dtype bytes x block size (2 MiB with
        the defaults)."""
        return (
            2
            * self.num_hidden_layers
            * self.num_key_value_heads
            * self.head_dim
            * self.kv_cache_dtype_bytes
            * self.block_size
        )

    @property
    def host_load_ms_per_token(self) -> float:
        """ms per token to load KV from the host tier (bandwidth only): what a router weighs a host hit by."""
        return self.kv_bytes_per_block / self.block_size * 8 / (self.host_kv_bandwidth_gbps * 1e9) * 1e3

    @model_validator(mode="after")
    def _check_consistent(self) -> MockEngineConfig:
        # vLLM refuses the same combinations at startup: a sequence that cannot fit the whole cache would be preempted
        # forever, and without chunked prefill a max_model_len prompt must fit one step's budget.
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_gpu_blocks * block_size = {self.num_gpu_blocks * self.block_size} tokens cannot hold one "
                f"sequence of max_model_len = {self.max_model_len} tokens"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len})"
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be greater than "
                f"max_model_len ({self.max_model_len})"
            )
        if self.eos_token_id is not None and self.eos_token_id >= self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside the vocabulary of {self.vocab_size}")
        return self
