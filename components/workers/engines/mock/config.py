"""Configuration of the simulated vLLM engine (``MockEngineConfig``): one pydantic model, every knob documented.

Names and defaults follow vLLM's engine arguments where vLLM has the knob (``num_gpu_blocks``, ``block_size``,
``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
``max_model_len``) and Dynamo's mocker where it does not (``speedup_ratio``).

The step-time model, the KV transfer and host-tier load times, and every default coefficient with where it comes from
are ``components.perf.model``'s (written once: the router predicts with the same model); the fields below take their
defaults from there. The host-memory KV tier (``num_host_blocks``, off by default) is what vLLM's offloading
connector, LMCache, Dynamo's KVBM and the Mooncake store add to an engine: every block that gets its hash on the device
is also written to an LRU cache of ``num_host_blocks`` blocks in host DRAM (write-through; the copy out runs beside the
compute and is not charged), and a request whose prefix continues in host memory past what the device caches loads
those blocks back instead of recomputing them, in the step that admits it. Its size: a DGX H100 has 2 TiB of DRAM for
8 GPUs, 256 GiB each; half of it for KV is 128 GiB = 65,536 blocks of 2 MiB, 4x the default device cache
(``kvmesh bench routing``'s default).

This module imports only the standard library, pydantic and ``components.perf`` (standard library only).
"""

from __future__ import annotations

import functools
import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from components.perf import model as perf
from components.perf.model import STEP_TIME_FIELDS, StepTimeModel

__all__ = ["STEP_TIME_FIELDS", "MockEngineConfig"]


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
    block_size: int = Field(default=perf.BLOCK_SIZE, ge=1, description="Tokens per KV block (vLLM's default on CUDA).")
    enable_prefix_caching: bool = Field(
        default=True,
        description="Keep full blocks, keyed by their chained hash, after their requests finish and reuse them for "
        "later requests with the same prefix. Off: no KV events are emitted at all.",
    )

    # --- Scheduler --------------------------------------------------------------------------------------------------
    max_num_seqs: int = Field(default=256, ge=1, description="Most running sequences (vLLM's long-standing default).")
    max_num_batched_tokens: int = Field(
        default=perf.MAX_NUM_BATCHED_TOKENS,
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
    enable_in_batch_prefix_caching: bool = Field(
        default=False,
        description="Hold a waiting request whose next uncached block another running request of this engine is "
        "computing right now (same chained hash at the same position, not yet stored) until that block is stored, "
        "then admit it with the longer cache hit, instead of computing the same prefix again beside it (SGLang's "
        "in-batch prefix caching; vLLM computes it twice). A held request keeps its place in the queue and does not "
        "hold up the requests behind it; it is admitted as soon as no running request is computing its next block "
        "(the holder finished that prefix, was preempted, aborted or suspended). Needs enable_prefix_caching. Off: "
        "vLLM's behaviour.",
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
        default=perf.PREFILL_BASE_MS, ge=0, description="Fixed cost of a step that prefills any tokens, in ms."
    )
    prefill_ms_per_token: float = Field(
        default=perf.PREFILL_MS_PER_TOKEN, ge=0, description="Prefill cost per new prompt token, in ms."
    )
    prefill_ms_per_token_sq: float = Field(
        default=perf.PREFILL_MS_PER_TOKEN_SQ,
        ge=0,
        description="Prefill cost per new prompt token squared (attention), in ms.",
    )
    decode_base_ms: float = Field(
        default=perf.DECODE_BASE_MS, ge=0, description="Fixed cost of a step that decodes any sequence, in ms."
    )
    decode_ms_per_seq: float = Field(
        default=perf.DECODE_MS_PER_SEQ, ge=0, description="Decode cost per sequence in the batch, in ms."
    )
    decode_ms_per_kv_token: float = Field(
        default=perf.DECODE_MS_PER_KV_TOKEN,
        ge=0,
        description="Decode cost per KV token attended (summed over the batch), in ms.",
    )

    # --- Model shape and KV transfer (disaggregated prefill) --------------------------------------------------------
    num_hidden_layers: int = Field(
        default=perf.NUM_HIDDEN_LAYERS,
        ge=1,
        description="Transformer layers of the simulated model (Llama-3-8B: 32); sizes its KV blocks.",
    )
    num_key_value_heads: int = Field(
        default=perf.NUM_KEY_VALUE_HEADS,
        ge=1,
        description="KV heads per layer (Llama-3-8B: 8, grouped-query attention); sizes its KV blocks.",
    )
    head_dim: int = Field(default=perf.HEAD_DIM, ge=1, description="Dimensions per attention head (Llama-3-8B: 128).")
    kv_cache_dtype_bytes: int = Field(
        default=perf.KV_CACHE_DTYPE_BYTES,
        ge=1,
        le=8,
        description="Bytes per KV cache element: 2 for bf16/fp16 (vLLM's auto), 1 for fp8.",
    )
    kv_transfer_bandwidth_gbps: float = Field(
        default=perf.KV_TRANSFER_BANDWIDTH_GBPS,
        gt=0,
        description="Bandwidth a KV transfer between a prefill and a decode worker gets, in gigabits per second "
        "(1e9 bit/s): one 400 Gb/s RDMA NIC per GPU. NVLink within a node: ~3600.",
    )
    kv_transfer_latency_ms: float = Field(
        default=perf.KV_TRANSFER_LATENCY_MS,
        ge=0,
        description="Fixed cost of one KV transfer, whatever its size, in ms (control messages).",
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
        default=perf.HOST_KV_BANDWIDTH_GBPS,
        gt=0,
        description="Bandwidth of loading KV blocks from the host tier to the device, in gigabits per second: PCIe "
        "Gen5 x16 from pinned memory (~50 GB/s).",
    )
    host_kv_latency_ms: float = Field(
        default=perf.HOST_KV_LATENCY_MS,
        ge=0,
        description="Fixed cost of one load from the host tier, whatever its size, in ms.",
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
        return perf.kv_bytes_per_block(
            num_hidden_layers=self.num_hidden_layers,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            kv_cache_dtype_bytes=self.kv_cache_dtype_bytes,
            block_size=self.block_size,
        )

    @property
    def host_load_ms_per_token(self) -> float:
        """ms per token to load KV from the host tier (bandwidth only): what a router weighs a host hit by."""
        return perf.host_load_ms_per_token(self.kv_bytes_per_block, self.block_size, self.host_kv_bandwidth_gbps)

    @functools.cached_property
    def step_time_model(self) -> StepTimeModel:
        """The step-time model this engine simulates (and announces): its coefficients in ``components.perf``'s
        model. Cached: the scheduler asks once per step."""
        return StepTimeModel(**{n: getattr(self, n) for n in STEP_TIME_FIELDS})

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
