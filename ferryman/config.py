"""Frozen configuration dataclasses.

`ModelConfig` is the engine's normalised view of a Hugging Face `config.json`: every architecture
file in `ferryman/models/` turns its own config dialect into this one shape, so layers and the
engine never read raw HF keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ferryman.errors import ConfigError

RouterKind = Literal["softmax_topk", "topk_softmax"]
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
class QuantConfig:
    method: str  # e.g. "mxfp4"
    modules_to_not_convert: tuple[str, ...] = ()


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
    router_kind: RouterKind
    router_bias: bool
    expert_act: ExpertAct
    expert_bias: bool
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts > 0 and not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"top-k {self.top_k} is not in 1..num_experts ({self.num_experts})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

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

    @property
    def expert_format(self) -> str:
        return self.quant.method if self.quant is not None else "dense"

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_str(self.torch_dtype)

    @staticmethod
    def from_hf(source: str | Path | dict[str, Any]) -> "ModelConfig":
        """Build from a model folder, a config.json path, or an already-parsed dict."""
        from ferryman.models.registry import get_architecture

        hf = source if isinstance(source, dict) else read_config_json(source)
        model_type = hf.get("model_type")
        if not model_type:
            raise ConfigError("config.json has no 'model_type'")
        try:
            return get_architecture(model_type).parse_config(hf)
        except KeyError as e:
            raise ConfigError(f"config.json of a {model_type} model lacks the field {e.args[0]!r}") from None


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


def read_config_json(source: str | Path) -> dict[str, Any]:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.parent.exists():
        raise ConfigError(f"model folder {path.parent} does not exist")
    if not path.exists():
        raise ConfigError(f"no config.json in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (transformers 5) or `rope_scaling` (4.x)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "yarn", "linear"):
        raise ConfigError(f"unsupported rope type {kind!r} (supported: default, yarn, linear)")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor") or 1.0),
        original_max_position=int(
            merged.get("original_max_position_embeddings")
            or hf.get("original_max_position_embeddings")
            or max_pos
        ),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=merged.get("attention_factor"),
        partial_rotary_factor=float(
            merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        ),
    )


def quant_from_hf(hf: dict[str, Any], supported: tuple[str, ...]) -> QuantConfig | None:
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "?")
    if method not in supported:
        raise ConfigError(
            f"unsupported quantization_config.quant_method {method!r} for "
            f"{hf.get('model_type')} (supported: {', '.join(supported) or 'none'})"
        )
    return QuantConfig(method=method, modules_to_not_convert=tuple(qc.get("modules_to_not_convert") or ()))


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache's storage dtype: the model's (auto) or float8 e4m3 (fp8: values saturate at
    +-448, no scale, as vLLM's fp8 KV without calibration). fp8 on CUDA needs compute capability
    8.9 or newer (the kernels convert with the hardware's e4m3 instructions)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                          f"this one is {major}.{minor}: use kv_cache_dtype auto")
    return torch.float8_e4m3fn


@dataclass(frozen=True)
class OffloadConfig:
    """What a user may choose about routed experts; `EngineConfig.offload` builds it."""

    gpu_memory: str | int | None = None  # device budget, e.g. "16GiB" (caps every allocation)
    moe_strategy: str = "auto"  # auto | resident | offload
    expert_cache: str | float | int | None = None  # a fraction ("10%", 0.1) or a slot count
    cpu_experts: str = "off"  # off | auto | on: misses computed on the CPU (experts/hybrid.py)
    calibration: str | None = None  # rates file of `ferryman bench bw` (default: the cache folder's)
    decode_prefetch: bool = True  # copy the next layer's guessed experts ahead in decode steps


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and the CLI flags set. Validated once, here."""

    model: str
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0  # dummy-weight seed
    max_model_len: int | None = None  # None: min(model context, 32768)
    max_num_seqs: int | None = None  # None: 32, or under a GPU budget the planner's pick (planner.py)
    # per step: prefill chunks + decodes; None: 2048, or 4096 when experts are offloaded (planner.py)
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: sized from memory (CUDA) or max_num_seqs x 2 x context cap (CPU)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # disable CUDA graphs
    gpu_memory_utilization: float = 0.9
    progress: bool = False
    # routed experts (ferryman/planner.py): a device budget like "16GiB" (caps every allocation),
    # auto | resident | offload, and the expert cache as a fraction ("10%", 0.1) or a slot count
    gpu_memory: str | int | None = None
    moe_strategy: str = "auto"
    expert_cache: str | float | int | None = None
    # misses computed on the CPU while others are fetched (experts/hybrid.py): off | auto | on;
    # "off" by default: on the GPU machine auto decoded 16 sequences 20% faster, but 16 served
    # users gained nothing (docs/benchmarks.md, session 12). calibration: the rates file (default:
    # ~/.cache/ferryman/calibration-<fingerprint>.json, written by `ferryman bench bw`)
    cpu_experts: str = "off"
    calibration: str | None = None
    # KV cache storage: auto (the model's dtype) | fp8 (e4m3, half of bf16's bytes; the attention
    # reads it back in the model's dtype). See `kv_dtype`.
    kv_cache_dtype: str = "auto"
    decode_prefetch: bool = True  # see OffloadConfig

    @property
    def offload(self) -> OffloadConfig:
        return OffloadConfig(self.gpu_memory, self.moe_strategy, self.expert_cache, self.cpu_experts,
                             self.calibration, self.decode_prefetch)

    def __post_init__(self) -> None:
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype != "auto":
            dtype_from_str(self.dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_experts()

    def _check_experts(self) -> None:
        from ferryman.planner import STRATEGIES, parse_bytes, parse_expert_cache

        if self.moe_strategy not in STRATEGIES:
            raise ConfigError(f"moe_strategy must be one of {', '.join(STRATEGIES)}, got {self.moe_strategy!r}")
        if self.gpu_memory is not None:
            parse_bytes(self.gpu_memory)
        if self.expert_cache is not None:
            parse_expert_cache(self.expert_cache)
        if self.cpu_experts not in ("off", "auto", "on"):
            raise ConfigError(f"cpu_experts must be one of off, auto, on, got {self.cpu_experts!r}")
        kv_dtype(self.kv_cache_dtype, torch.bfloat16)  # the name; the device's support is checked at engine start

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
