"""Frozen configuration dataclasses, and the parsing of the values users write into them.

`ModelConfig` is the engine's normalised view of a Hugging Face `config.json`: every architecture
file in `ferryman/models/` turns its own config dialect into this one shape (models/registry.py:
`model_config`), so layers and the engine never read raw HF keys. `EngineConfig` and
`OffloadConfig` hold what a user chooses (docs/configuration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

from ferryman.errors import ConfigError
from ferryman.units import GiB, MiB, parse_bytes, parse_expert_cache  # noqa: F401  (re-exported)

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid"]
ExpertAct = Literal["silu", "swiglu_oai"]
QKNorm = Literal["none", "head", "full"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: Literal["default", "yarn", "linear"] = "default"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): heads, head sizes and the short convolution."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped per key head)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): k and v come from one compressed latent of
    `kv_lora_rank` values plus a `qk_rope_head_dim` rope key shared by all heads; the KV cache
    holds those kv_lora_rank + qk_rope_head_dim values per token (layers/mla.py)."""

    q_lora_rank: int | None  # None: q comes from one projection (q_proj), else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope pairs are (x0, x1), (x2, x3), ... in the checkpoint's layout
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantisation, read from `quantization_config` (quant/hf_quant.py)."""

    method: str  # quantization_config.quant_method: "mxfp4", "fp8", "compressed-tensors", "modelopt", ...
    format: str = ""  # the routed experts' ExpertFormat name ("": the method's name, as "mxfp4")
    # how one quantised Linear's tensors look in the files (quant/linear_layouts.py); "": the
    # architecture lists them itself (gpt-oss's mxfp4 experts)
    linear: str = ""
    ignore: tuple[str, ...] = ()  # modules left unquantised: exact module names or "re:" patterns (re.match)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # routed experts
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    router_kind: RouterKind = "softmax_topk"
    router_bias: bool = False
    # "sigmoid" routing (DeepSeek-V3, GLM-4.5; layers/router.py): experts chosen on sigmoid(logits) +
    # e_score_correction_bias within the topk_group best of n_group groups, weighted by the
    # unbiased scores (renormalised when norm_topk_prob) times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # shared experts: a dense SwiGLU MLP of this width beside the routed experts of every MoE layer
    shared_intermediate_size: int = 0
    expert_act: ExpertAct = "silu"
    expert_bias: bool = False
    # dense FFN, for layers listed in dense_layers
    intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # attention
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None
    attn_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    # misc
    rms_norm_eps: float = 1e-6
    norm_weight_fp32: bool = False  # gpt-oss multiplies the norm weight before casting back
    tie_word_embeddings: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    quant: QuantConfig | None = None
    mla: MLAConfig | None = None  # multi-head latent attention instead of q/k/v heads (head_dim: the rope part)
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer: never loaded
    # hybrid models (layer_types "linear_attention"); gated attention; shared expert
    linear_attn: LinearAttnConfig | None = None
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: o * sigmoid(gate)
    norm_unit_offset: bool = False  # RMSNorm weights stored as w - 1 (the norm multiplies by 1 + w)
    shared_expert_gate: bool = False  # the shared experts' output scaled by sigmoid(x @ gate)
    # per layer ("" if dense) when layers differ (GGUF mixes, e.g. Q4_K_M); empty: expert_format everywhere
    expert_formats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts > 0 and not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"top-k {self.top_k} is not in 1..num_experts ({self.num_experts})")
        if self.router_kind == "sigmoid":
            self._check_groups()
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

    def _check_groups(self) -> None:
        """Group-limited routing needs equal groups of >= 2 experts (a group's score is the sum of
        its best two) and enough experts in the chosen groups for top-k."""
        E, G = self.num_experts, self.n_group
        if G < 1 or E % G or (G > 1 and E // G < 2):
            raise ConfigError(f"n_group {G} must divide n_routed_experts ({E}) into groups of at least 2 experts")
        if not 1 <= self.topk_group <= G:
            raise ConfigError(f"topk_group {self.topk_group} is not in 1..n_group ({G})")
        if self.top_k > self.topk_group * (E // G):
            raise ConfigError(f"num_experts_per_tok {self.top_k} exceeds the experts of topk_group "
                              f"{self.topk_group} groups of {E // G}")

    # ---- derived views -------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a layer, or None for full attention."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    def is_linear_layer(self, layer: int) -> bool:
        """A gated DeltaNet layer: recurrent state instead of KV."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep KV (every layer but the linear-attention ones)."""
        return sum(1 for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def expert_format(self) -> str:
        """The routed experts' format (with per-layer formats: the most common one)."""
        if self.quant is None:
            return "dense"
        return self.quant.format or self.quant.method

    def expert_format_of(self, layer: int) -> str:
        """The format of one MoE layer's routed experts."""
        return self.expert_formats[layer] if self.expert_formats else self.expert_format

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_str(self.torch_dtype)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def dtype_from_str(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return _DTYPES[key]


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache's storage dtype: the model's (auto) or float8 e4m3 (fp8: values saturate at
    +-448, no scale). fp8 on CUDA needs compute capability 8.9 or newer (the kernels convert with
    the hardware's e4m3 instructions)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                          f"this one is {major}.{minor}: use kv_cache_dtype auto")
    return torch.float8_e4m3fn


# where routed experts live and compute (docs/configuration.md); "layers:N" names N explicitly
STRATEGIES = ("auto", "resident", "offload", "hybrid", "cpu", "layers")
PREFILL_MODES = ("auto", "layer", "chunk")
# how an offloaded decode step reaches experts not cached: "copy" them into slots, layer by layer (one
# host step per MoE layer), or "link": the whole step is one CUDA graph whose decode kernel reads
# them from pinned host memory (experts/link_table.py); "auto": the planner's choice by format and
# strategy (planner.plan_decode_misses; the A/B: benchmarks/bench_offload.py --decode-misses)
DECODE_MISSES = ("auto", "copy", "link")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEFAULT_CONTEXT_CAP = 32768  # max_model_len when unset: the model's context, at most this; the KV floor per sequence


def parse_strategy(value: str) -> tuple[str, int | None]:
    """(strategy, N) of a moe_strategy: one of STRATEGIES, or "layers:N" (the first N MoE layers'
    experts on the CPU, N >= 0); N is None unless given."""
    name, sep, count = value.partition(":")
    if name not in STRATEGIES or (sep and name != "layers"):
        raise ConfigError(f"moe_strategy must be one of {', '.join(STRATEGIES)} or layers:N, got {value!r}")
    if not sep:
        return name, None
    if not count.isdigit():
        raise ConfigError(f"moe_strategy layers:N needs a whole number N >= 0, got {value!r}")
    return name, int(count)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """What a user may choose about routed experts (docs/configuration.md has each field's flag)."""

    gpu_memory: str | int | None = None  # device budget, e.g. "16GiB" (a string needs a unit; an int is bytes)
    # auto | resident | offload | hybrid | cpu | layers[:N] (docs/configuration.md, experts/placement.py)
    moe_strategy: str = "auto"
    expert_cache: str | float | int | None = None  # a share ("10%", 0.1) or a slot count; None: the plan's rest
    calibration: str | None = None  # rates file of `ferryman bench bw` (None: the cache folder's)
    decode_prefetch: bool = True  # copy the next layer's guessed experts ahead in decode steps

    def __post_init__(self) -> None:
        parse_strategy(self.moe_strategy)
        if self.gpu_memory is not None:
            parse_bytes(self.gpu_memory)
        if self.expert_cache is not None:
            parse_expert_cache(self.expert_cache)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` keyword arguments and the CLI flags set, validated here, once.

    The routed-expert fields (gpu_memory .. decode_prefetch) are read through `offload`."""

    model: str
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    quantization: str = "none"  # dummy weights' format: none | fp8 | nvfp4 ... (quant/hf_quant.py QUANTIZATIONS)
    config_folder: str | None = None  # GGUF: config.json / tokenizer from this HF folder, not the metadata
    seed: int = 0  # dummy-weight seed
    max_model_len: int | None = None  # None: min(model context, 32768)
    max_num_seqs: int | None = None  # None: 32, or under a GPU budget the planner's pick
    max_num_batched_tokens: int | None = None  # tokens per step (+ a last piece's tail); None: 2048, or 4096 offloaded
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: sized from memory (CUDA) or from the context (CPU)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    gpu_memory_utilization: float = 0.9
    progress: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, see `kv_dtype`)
    min_expert_slots: int | None = None  # offload: slots KV never takes back (None: 2 layers' experts)
    kv_reserve_tokens: int | None = None  # offload: free KV kept when idle pages become slots (None: one step)
    gpu_memory: str | int | None = None
    moe_strategy: str = "auto"
    expert_cache: str | float | int | None = None
    calibration: str | None = None
    decode_prefetch: bool = True
    prefill_mode: str = "auto"  # auto | layer | chunk: prompts longer than a step (planner_search.prefill_plan)
    decode_misses: str = "auto"  # auto | copy | link: the planner's choice, or forced (planner.py)

    @cached_property
    def offload(self) -> OffloadConfig:
        """The routed-expert fields as one OffloadConfig (built, so validated, once)."""
        return OffloadConfig(self.gpu_memory, self.moe_strategy, self.expert_cache, self.calibration,
                             self.decode_prefetch)

    def __post_init__(self) -> None:
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype != "auto":
            dtype_from_str(self.dtype)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if not isinstance(self.quantization, str) or not self.quantization:
            raise ConfigError(f"quantization must be a format name such as fp8, got {self.quantization!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "kv_cache_tokens",
                     "min_expert_slots", "kv_reserve_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        kv_dtype(self.kv_cache_dtype, torch.bfloat16)  # the name; the device's support is checked at start
        _ = self.offload  # builds, so validates, the routed-expert fields
        _check_choice("prefill_mode", self.prefill_mode, PREFILL_MODES)
        _check_choice("decode_misses", self.decode_misses, DECODE_MISSES)

    def context_len(self, cfg: ModelConfig) -> int:
        """max_model_len, or the model's context capped at DEFAULT_CONTEXT_CAP; ConfigError past the model's."""
        ctx = cfg.max_position_embeddings
        if self.max_model_len is None:
            return min(ctx, DEFAULT_CONTEXT_CAP)
        if self.max_model_len > ctx:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context ({ctx})")
        return self.max_model_len

    def torch_device(self) -> torch.device:
        """The device, with an index on CUDA (some torch.cuda calls refuse a bare 'cuda')."""
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} was asked for but torch sees no CUDA device")
        dev = torch.device(name)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
