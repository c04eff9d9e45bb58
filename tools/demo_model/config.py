"""Settings of the demo-model pipeline: the real preset (one H200, ~8 minutes) and a tiny one.

Sizes are checked before any training: the bf16 safetensors file must stay <= 40 MiB.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

MAX_SAFETENSORS_BYTES = 40 * 1024 * 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of the Qwen3-MoE model (every layer is an MoE layer)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 10
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 32
    top_k: int = 4
    moe_intermediate_size: int = 64  # multiple of 32 so MXFP4 blocks (32 values) fit exactly
    max_position_embeddings: int = 2048  # the positions it is built for (trained on seq_len windows)
    rope_theta: float = 10000.0
    yarn_factor: float = 16.0  # the exported config serves max_position_embeddings x this through YaRN
    rms_norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.01
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={self.vocab_size} cannot hold the 256 byte tokens and the special tokens")
        if self.yarn_factor < 1:
            raise ValueError(f"yarn_factor={self.yarn_factor} must be >= 1 (1: no scaling)")

    @property
    def served_context(self) -> int:
        """max_position_embeddings of the exported config.json."""
        return int(self.max_position_embeddings * self.yarn_factor)

    def served_rope(self) -> dict:
        """rope_parameters of the exported config.json: YaRN over the built-for positions (the
        transformers defaults for beta_fast, beta_slow and the attention factor 0.1 ln(factor) + 1)."""
        if self.yarn_factor == 1:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, "factor": self.yarn_factor,
                "original_max_position_embeddings": self.max_position_embeddings}


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """Optimiser, schedule and budget. Training stops at max_steps or after `minutes`, whichever is first."""

    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    max_steps: int = 1_000_000
    minutes: float = 8.0
    log_every: int = 10
    eval_batch_size: int = 16
    max_eval_windows: int | None = None  # None: the whole held-out split
    val_every: int = 50  # steps between validation checks (the best weights are kept)
    max_val_windows: int = 64
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.max_steps <= 0:
            raise ValueError(f"training budget must be positive: minutes={self.minutes}, max_steps={self.max_steps}")
        if self.seq_len < 2 or self.batch_size < 1 or self.log_every < 1 or self.val_every < 1:
            raise ValueError(f"bad seq_len={self.seq_len}, batch_size={self.batch_size} or log_every={self.log_every}")


@dataclass(frozen=True, slots=True)
class CorpusSpec:
    """Which stdlib files are used; the tiny preset keeps a small, stable subset."""

    include_tests: bool = True
    max_train_files: int | None = None
    max_val_files: int | None = None
    max_heldout_files: int | None = None
    max_file_bytes: int | None = None  # files larger than this are skipped (tiny preset only)


@dataclass(frozen=True, slots=True)
class BuildSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    routing_tokens: int = 16384  # held-out tokens replayed for the card's routing statistics
    tiny: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def real_spec(minutes: float = 8.0) -> BuildSpec:
    return BuildSpec(train=TrainSpec(minutes=minutes))


def tiny_spec() -> BuildSpec:
    """A smoke-test preset: runs end to end in seconds on 2 CPU cores."""
    model = ModelSpec(
        vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        num_experts=8, top_k=4, moe_intermediate_size=32,
    )
    train = TrainSpec(
        seq_len=128, batch_size=8, lr=3e-3, warmup_steps=5, max_steps=30, minutes=5.0,
        log_every=5, eval_batch_size=8, max_eval_windows=8, val_every=10, max_val_windows=4,
    )
    corpus = CorpusSpec(max_train_files=40, max_val_files=4, max_heldout_files=6, max_file_bytes=20_000)
    return BuildSpec(model=model, train=train, corpus=corpus, routing_tokens=1024, tiny=True)


def with_overrides(spec: BuildSpec, **train_overrides: object) -> BuildSpec:
    """Copy of `spec` with some TrainSpec fields replaced (None values are ignored)."""
    kept = {k: v for k, v in train_overrides.items() if v is not None}
    return replace(spec, train=replace(spec.train, **kept))


def hf_config(spec: ModelSpec, eos_id: int) -> Qwen3MoeConfig:
    """The transformers `qwen3_moe` config of the demo model (all layers sparse, tied embeddings)."""
    return Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.hidden_size,  # dense-MLP width; unused since every layer is MoE
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )


def count_parameters(config: Qwen3MoeConfig) -> int:
    """Exact parameter count of the transformers model (tied embedding counted once), built on `meta`."""
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def safetensors_names(config: Qwen3MoeConfig) -> list[str]:
    """Tensor names of the canonical Qwen3-MoE checkpoint layout (per-expert, lm_head tied away)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        names += [prefix + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                       "mlp.gate.weight")]
        names += [f"{prefix}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{prefix}mlp.experts.{e}.{p}.weight" for e in range(config.num_experts)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    return sorted(names)


def safetensors_header_bytes(config: Qwen3MoeConfig) -> int:
    """Upper bound of the safetensors JSON header for the canonical tensor names."""
    entry = {"dtype": "BF16", "shape": [99999, 99999], "data_offsets": [9_999_999_999, 9_999_999_999]}
    header = {name: entry for name in safetensors_names(config)}
    header["__metadata__"] = {"format": "pt"}
    return 8 + len(json.dumps(header, separators=(",", ":"))) + 8  # length prefix, JSON, alignment padding


def check_size(config: Qwen3MoeConfig, limit: int = MAX_SAFETENSORS_BYTES) -> int:
    """Bytes of the bf16 safetensors file (payload exact, header bounded); raises if over `limit`."""
    total = count_parameters(config) * BF16_BYTES + safetensors_header_bytes(config)
    if total > limit:
        raise ValueError(
            f"model config gives a {total / 2**20:.2f} MiB bf16 safetensors file, over the "
            f"{limit / 2**20:.0f} MiB limit: shrink layers, experts or moe_intermediate_size"
        )
    return total
