"""The memory plan: how a GPU budget splits between weights, KV cache, activations and experts.

    budget = non-expert weights + KV cache + activation headroom + expert cache (the rest)

An offloaded plan shares one region between KV blocks and expert slots (kvcache/shared_region.py,
engine/memory_split.py): its floor is one sequence of max_model_len plus `min_expert_slots`, the
experts start with the other pages; max_num_seqs x max_model_len reserves nothing.

Otherwise the KV cache gets its floor first: min(max_model_len, 32768) tokens for each of `max_num_seqs`
sequences (or exactly `kv_cache_tokens`), in every layer but the sliding-window ones of a model that
mixes both, which keep only their window in a pool of fixed size (kvcache/window_pool.py). The expert
cache gets the rest, in slots of one expert; if every routed expert fits the plan is resident and
what is left grows the KV cache. An offloaded plan keeps the token-embedding table in host RAM, its
bytes becoming slots. A budget that cannot hold the floor is refused with the amount missing.
The plan reads no environment; without a budget (CPU) nothing is limited and offload needs an
explicit `expert_cache`.

This file holds the sizes and the plan's request and result; planner_split.py splits a budget for
fixed choices, planner_search.py makes the choices (step size, prefill mode, concurrency) by
splitting again: `plan_memory`, `plan_auto_seqs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferryman.config import DEFAULT_CONTEXT_CAP, MiB, ModelConfig, parse_strategy
from ferryman.errors import ConfigError
from ferryman.quant.layout import ExpertLayout
from ferryman.kvcache.state_checkpoints import CHECKPOINTS_PER_SEQ
from ferryman.kvcache.shared_region import PageGeometry
from ferryman.kvcache.state_pool import state_bytes_per_seq
from ferryman.kvcache.window_pool import num_window_layers, window_pool_blocks, window_split
from ferryman.layers import batched_moe, fused_moe
from ferryman.prefill_steps import step_tokens
from ferryman.quant.base import get_format

# allocator slack, cuBLAS workspace, CUDA graph pools: the activation estimate's only margin
_FIXED_HEADROOM = 192 * MiB


def expert_slots(cache: float | int, total: int) -> int:
    """Slots for `cache` (fraction or count) out of `total` experts, at least 1, at most total."""
    n = round(cache * total) if isinstance(cache, float) else cache
    return max(1, min(total, n))


def kv_values_per_token(cfg: ModelConfig) -> int:
    """Cached values of one token in one layer: K and V of each kv head, or MLA's latent + rope key."""
    return cfg.mla.cache_dim if cfg.mla is not None else 2 * cfg.num_kv_heads * cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
    """The cache of one token in `layers` layers (None: all that keep KV)."""
    return (cfg.num_attention_layers if layers is None else layers) * kv_values_per_token(cfg) * dtype.itemsize


def activation_bytes(cfg: ModelConfig, dtype: torch.dtype, chunk_tokens: int, max_seqs: int,
                     kernels: str = "auto") -> int:
    """Estimated peak of transient tensors for a prefill chunk of `chunk_tokens` (+ _FIXED_HEADROOM).

    Per token: residual, norm and block outputs (6 H), q/k/v and attention output, and the larger
    MLP: per routed pair the MoE gate_up / activation ([2I] + [I]), an fp32 output row and the
    sorted input row (H), plus the shared experts' gate_up / activation; or a dense layer's;
    once: the prefill path's dequantised w13 banks (2 I H each) and fp32 logits of the sampled rows.
    kernels: the MoE kernels the engine runs (PlanRequest.kernels)."""
    item = dtype.itemsize
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, max(cfg.top_k, 1)
    q, kv = cfg.num_heads * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim
    if cfg.mla is not None:  # q and its absorbed form, the latent output, W_UV's output
        q, kv = cfg.num_heads * (cfg.mla.qk_head_dim + cfg.mla.cache_dim), cfg.num_heads * (
            cfg.mla.kv_lora_rank + cfg.mla.v_head_dim)
    moe = k * (item * (3 * i + h) + 4 * h) + item * 3 * cfg.shared_intermediate_size
    dense = item * 3 * cfg.intermediate_size if cfg.num_layers > len(cfg.moe_layers) else 0
    per_token = item * (6 * h + 2 * q + kv) + max(moe, dense)
    # experts the chunk's CUDA prefill path dequantises at once: a group if batched, none if grouped
    batched = fused_moe.prefill_path(cfg.expert_format, chunk_tokens * k, kernels) == "batched"
    once = (batched_moe.prefill_group(i, h, item) if batched else 0) * 2 * i * h * item + 2 * max_seqs * cfg.vocab_size * 4
    return chunk_tokens * per_token + once + _FIXED_HEADROOM


def non_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the module tree (models/transformer.py): everything but the routed experts;
    shared experts and the dense layers' MLPs included."""
    h = cfg.hidden_size
    attn = attention_params(cfg)
    moe = router_params(cfg) + 3 * cfg.shared_intermediate_size * h + h * cfg.shared_expert_gate  # + shared experts
    dense_mlp = 3 * cfg.intermediate_size * h  # gate_up_proj, down_proj
    mixer = [linear_attn_params(cfg) if cfg.is_linear_layer(i) else attn for i in range(cfg.num_layers)]
    layers = sum(2 * h + mixer[i] + (moe if cfg.is_moe_layer(i) else dense_mlp) for i in range(cfg.num_layers))
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)  # a tied lm_head shares the table
    return embed + layers + h  # + the final norm


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one attention layer (layers/attention.py or layers/mla.py)."""
    h, hd, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.mla is not None:
        m, heads = cfg.mla, cfg.num_heads
        qp = heads * m.qk_head_dim * h if m.q_lora_rank is None else (
            m.q_lora_rank * (h + 1 + heads * m.qk_head_dim) + m.q_lora_rank * cfg.attention_bias)
        kv_a = m.cache_dim * (h + cfg.attention_bias) + m.kv_lora_rank  # + kv_a_layernorm
        kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return qp + kv_a + kv_b + heads * m.v_head_dim * h + h * cfg.attention_bias
    attn = (q * (2 if cfg.attn_output_gate else 1) + 2 * kv) * h + q * h  # qkv_proj (+ output gate), o_proj
    attn += (q + 2 * kv) * cfg.attention_bias + h * cfg.attention_out_bias
    return attn + {"none": 0, "head": 2 * hd, "full": q + kv}[cfg.qk_norm] + cfg.num_heads * cfg.attn_sinks


def router_params(cfg: ModelConfig) -> int:
    """One MoE layer's router: weight, bias, and a sigmoid router's score correction bias."""
    return cfg.num_experts * (cfg.hidden_size + cfg.router_bias + (cfg.router_kind == "sigmoid"))


def linear_attn_params(cfg: ModelConfig) -> int:
    """Parameters of one gated DeltaNet layer (layers/gated_deltanet.py)."""
    la, h = cfg.linear_attn, cfg.hidden_size
    assert la is not None
    projections = (la.conv_dim + la.value_dim + 2 * la.num_v_heads) * h + la.value_dim * h  # in_proj_*, out_proj
    return projections + la.conv_dim * la.conv_kernel + 2 * la.num_v_heads + la.v_head_dim  # conv, dt_bias, A_log, norm


def non_expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of non_expert_params in `dtype`, a sigmoid router's in fp32 (layers/router.py)."""
    fp32 = router_params(cfg) * len(cfg.moe_layers) if cfg.router_kind == "sigmoid" else 0
    return (non_expert_params(cfg) - fp32) * dtype.itemsize + fp32 * 4


def host_embedding_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the token-embedding table an offloaded plan keeps in host RAM: a lookup is a row
    gather on the host and a [T, H] copy, and its vocab x hidden bytes become expert slots. 0 when
    lm_head shares the table (tied)."""
    return 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * dtype.itemsize


def row_bytes(cfg: ModelConfig, dtype: torch.dtype, fmt: str) -> int:
    """Bytes of one expert in format `fmt`, all its banks, aligned as the host store lays it out."""
    specs = get_format(fmt).bank_specs(1, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, dtype)
    return ExpertLayout.of(specs).row_bytes


def slot_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one cache slot: one expert of the widest layer (layers differ in mixed-format models)."""
    formats = set(cfg.expert_formats) - {""} or {cfg.expert_format}
    return max(row_bytes(cfg, dtype, f) for f in formats)


def all_expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every routed expert, each layer in its own format (what resident experts take)."""
    if not cfg.expert_formats:
        return len(cfg.moe_layers) * cfg.num_experts * slot_bytes(cfg, dtype)
    return sum(cfg.num_experts * row_bytes(cfg, dtype, cfg.expert_format_of(i)) for i in cfg.moe_layers)


@dataclass(frozen=True)
class PlanRequest:
    cfg: ModelConfig
    dtype: torch.dtype
    budget: int | None  # bytes; None = unlimited
    max_model_len: int
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: DEFAULT_CHUNK, or OFFLOAD_CHUNK when offloaded
    block_size: int = 16
    kv_cache_tokens: int | None = None
    strategy: str = "auto"
    expert_cache: float | int | None = None
    kv_dtype: torch.dtype | None = None  # the KV cache's storage dtype; None: dtype
    kernels: str = "auto"  # the MoE kernels: auto | torch | triton (a machine fact: FERRYMAN_KERNELS)
    min_expert_slots: int | None = None  # an offloaded plan's slot floor (None: top_k)
    prefill_mode: str = "auto"  # auto | layer | chunk: how prompts longer than a step run (planner_search.py)
    decode_misses: str = "auto"  # auto | copy | link: how offloaded decode reaches misses (`plan_decode_misses`)

    @property
    def kv_per_token(self) -> int:
        """A token's KV in the main pool: every layer's but the window pool's."""
        layers = self.cfg.num_attention_layers - num_window_layers(self.cfg)
        return kv_bytes_per_token(self.cfg, self.kv_dtype or self.dtype, layers)

    @property
    def window_blocks(self) -> int:
        """Blocks of the sliding-window layers' own pool (0: none, kvcache/window_pool.py)."""
        window = window_split(self.cfg)
        if window is None:
            return 0
        chunk = self.max_num_batched_tokens or DEFAULT_CHUNK
        return window_pool_blocks(window, self.block_size, self.max_num_seqs, step_tokens(chunk))

    @property
    def window_kv_bytes(self) -> int:
        layers = num_window_layers(self.cfg)
        return self.window_blocks * self.block_size * kv_bytes_per_token(self.cfg, self.kv_dtype or self.dtype, layers)

    @property
    def state_bytes(self) -> int:
        """The linear-attention layers' state pool on the device: a slot per sequence (kvcache/state_pool.py)."""
        return state_bytes_per_seq(self.cfg, self.dtype) * self.max_num_seqs

    @property
    def total_experts(self) -> int:
        return len(self.cfg.moe_layers) * self.cfg.num_experts

    @property
    def slot_floor(self) -> int:
        """Expert slots an offloaded plan never goes below: min_expert_slots, at least top_k."""
        return min(self.total_experts, max(self.cfg.top_k, 1, self.min_expert_slots or 0))

    @property
    def shared_floor_tokens(self) -> int:
        """KV tokens a shared region keeps at least: one sequence of max_model_len, or kv_cache_tokens."""
        return self.kv_cache_tokens or round_up(self.max_model_len, self.block_size)

    @property
    def kv_floor_tokens(self) -> int:
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        return round_up(min(self.max_model_len, DEFAULT_CONTEXT_CAP), self.block_size) * self.max_num_seqs


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    strategy: str  # "resident" | "offload"
    weights_bytes: int
    kv_tokens: int | None  # None: no budget, the engine sizes the KV cache itself
    kv_bytes: int
    activation_bytes: int
    slot_bytes: int  # one expert (a cache slot)
    expert_slots: int  # == total experts when resident
    host_embedding_bytes: int = 0  # the token-embedding table kept in host RAM (offload), not in weights_bytes
    state_bytes: int = 0  # the linear-attention state pool (hybrid models), on the device
    # offload: the region KV blocks and expert slots share (kvcache/shared_region.py); None: resident
    pages: PageGeometry | None = None

    @property
    def shared(self) -> bool:
        return self.pages is not None

    @property
    def region_pages(self) -> int:
        """Pages of the shared region: the experts' first slots and the KV cache's first pages."""
        if self.pages is None or self.kv_tokens is None:
            return 0
        return self.expert_slots + self.pages.pages_for_tokens(self.kv_tokens, self.request.block_size)
    cpu_layers: int = 0  # the first MoE layers whose experts the CPU computes (strategies cpu, layers)
    # layer-major prefill (engine/layer_prefill.py): the most prompt tokens one job holds (0: chunk-major
    # only); their hidden states wait between layers on the device, counted in activation_bytes
    prefill_job_tokens: int = 0

    @property
    def checkpoint_host_bytes(self) -> int:
        """Host RAM of the prefix cache's state checkpoints (kvcache/state_checkpoints.py): never device
        memory, so an agent's checkpoints cost no KV or expert slots."""
        return CHECKPOINTS_PER_SEQ * self.state_bytes

    @property
    def host_embedding(self) -> bool:
        return self.host_embedding_bytes > 0

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * (self.pages.page_bytes if self.pages is not None else self.slot_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.expert_cache_bytes + self.state_bytes

    @property
    def decode_misses(self) -> str:
        return plan_decode_misses(self.request, self.strategy, self.cpu_layers)


# How an offloaded decode step reaches the experts its slots lack (experts/link_table.py,
# engine/segment_graphs.py):
#   copy: each MoE layer reads its routing on the host, copies its misses into slots, then computes;
#   link: the whole step is one CUDA graph whose decode kernel reads misses from pinned host memory.
# Link wins where the kernel reads host memory about as fast as a copy (ExpertFormat.link_reads): on
# the H200 machine 1.45x copy's decode at one sequence in bf16, 1.6x in fp8, 2.4x in int4 and Q4_K_M;
# MXFP4, read at half the copy rate, decoded at 0.64x (docs/benchmarks.md). Link steps need every MoE
# layer on the GPU path: no hybrid split, no CPU layers, the Triton decode kernel. Link steps admit
# misses selectively, so where routing is wide the hit rate falls (gpt-oss-120b int4: 0.24 against
# 0.54, 13.9 against 23.0 tok/s): auto's link reads stand on trial against copies while serving
# (experts/split_trial.link_reads_trial).
LINK_STRATEGIES = ("auto", "offload")
# link steps run while a step's (token, k) pairs number at most this share of a layer's experts
LINK_MAX_SHARE = 0.5


def link_step_fits(cfg: ModelConfig, seqs: int) -> bool:
    """A decode step of `seqs` sequences runs as a link step: its pairs fit the decode kernel, and they
    are few enough beside a layer's experts that few share an uncached one (the per-pair kernel reads
    a shared expert over the link once per pair)."""
    return seqs * cfg.top_k <= min(fused_moe.DECODE_MAX_PAIRS, LINK_MAX_SHARE * cfg.num_experts)


def link_blockers(req: PlanRequest, cpu_layers: int) -> list[str]:
    """What an offloaded plan lacks for link steps, each as "<what it needs>, not <what it has>"."""
    wants = ((f"moe_strategy auto or offload, not {req.strategy!r}",
              parse_strategy(req.strategy)[0] not in LINK_STRATEGIES or bool(cpu_layers)),
             ("the Triton kernels, not FERRYMAN_KERNELS=torch", req.kernels == "torch"))
    return [why for why, missing in wants if missing]


def plan_decode_misses(req: PlanRequest, strategy: str, cpu_layers: int) -> str:
    """copy | link for an offloaded plan (copy when resident: nothing misses); auto picks link when
    the strategy allows it and every MoE layer's format reads well over the link."""
    if strategy != "offload" or req.decode_misses == "copy":
        return "copy"
    blocked = link_blockers(req, cpu_layers)
    if req.decode_misses == "link":
        if blocked:
            raise ConfigError(f"decode_misses 'link' needs {' and '.join(blocked)}")
        return "link"
    formats = {req.cfg.expert_format_of(i) for i in req.cfg.moe_layers}
    return "link" if not blocked and all(get_format(f).link_reads for f in formats) else "copy"


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Tokens per step when max_num_batched_tokens is left to the planner. Offloaded experts stream
# (about) every uncached expert once per prefill chunk, so a longer chunk moves fewer bytes per
# token (docs/benchmarks.md).
DEFAULT_CHUNK = 2048
OFFLOAD_CHUNK = 4096


def prefill_job_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Device bytes of a layer-major job's hidden states between layers: the stream and the
    residual, [tokens, H] each (engine/layer_prefill.py)."""
    return 2 * tokens * cfg.hidden_size * dtype.itemsize
