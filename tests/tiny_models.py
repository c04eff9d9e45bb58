"""Tiny random Hugging Face models of every supported architecture, built with transformers itself.

Biases, sinks and norms that transformers initialises to constants are randomised so those code
paths are tested. gpt-oss is saved with real MXFP4 blocks and scales; the in-memory reference model
gets the weights transformers' own dequantiser produces from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

if TYPE_CHECKING:
    from ferryman.calibrate.calibration import Calibration
    from ferryman.config import ModelConfig

COMMON = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
)
CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                      norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6),
    "olmoe": dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32, norm_topk_prob=False,
                  clip_qkv=2.0, eos_token_id=None, pad_token_id=None),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=12),
    # groups of 2 experts, 2 of 4 groups chosen: the group limit decides; layer 0 dense
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                     moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                     partial_rotary_factor=0.5, rms_norm_eps=1e-5),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, original_max_position_embeddings=64, truncate=False)),
}
# hybrid models: 4 layers (3 gated DeltaNet, 1 gated full attention), grouped value heads, a shared expert
HYBRID = dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
CONFIGS.update({
    "qwen3_next": dict(HYBRID, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]),
    "qwen3_5_moe_text": dict(HYBRID),
    "qwen3_5_moe": dict(HYBRID),  # the vision-language layout: text_config + a (tiny) vision tower
})
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)
# DeepSeek-V3 (MLA, sigmoid group-limited routing with a correction bias, a shared expert, a first
# dense layer, yarn with mscale): q through a LoRA pair, and through one q_proj (q_lora_rank null)
_DEEPSEEK = dict(
    num_key_value_heads=4, head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=96, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    first_k_dense_replace=1, eos_token_id=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                         mscale=0.9, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0),
)
CONFIGS["deepseek_v3"] = dict(_DEEPSEEK, q_lora_rank=24, norm_topk_prob=True)
CONFIGS["deepseek_v3_q_proj"] = dict(_DEEPSEEK, q_lora_rank=None, norm_topk_prob=False, rope_interleave=False)
MODEL_TYPES = {"deepseek_v3_q_proj": "deepseek_v3"}  # CONFIGS keys that are variants of a model_type
ARCHS = list(CONFIGS)


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the size of sigmoid scores' spread: it decides
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # slow decays: the recurrent state remembers the whole prompt
                p.copy_(torch.empty(p.shape).uniform_(0.005, 0.05, generator=gen).log())
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * 2.0)


def build_tiny(arch: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Save a tiny `arch` checkpoint to `folder`; return the transformers reference model (fp32, eager)."""
    torch.manual_seed(seed)
    if arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        cfg = Qwen3_5MoeConfig(text_config={**COMMON, **CONFIGS[arch]}, vision_config=VISION, tie_word_embeddings=False)
        model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    else:
        cfg = AutoConfig.for_model(MODEL_TYPES.get(arch, arch), **{**COMMON, **CONFIGS[arch]})
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    _randomise(model, gen)
    model.save_pretrained(folder)
    if arch == "gpt_oss":
        _write_mxfp4(model, folder, gen)
    if arch == "qwen3_5_moe":
        _fuse_experts(folder)
    return model


def _fuse_experts(folder: Path) -> None:
    """Rewrite per-expert tensors as the published Qwen3.5 checkpoints hold them: per layer
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]."""
    import re

    from safetensors.torch import load_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    per_expert = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if per_expert.match(n)]:
        prefix, e, proj = per_expert.match(name).groups()
        groups.setdefault(prefix, {}).setdefault(int(e), {})[proj] = tensors.pop(name)
    for prefix, experts in groups.items():
        order = sorted(experts)
        tensors[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        tensors[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write_mxfp4(model: torch.nn.Module, folder: Path, gen: torch.Generator) -> None:
    """Replace the dense expert tensors with random MXFP4 blocks/scales; load their dequantised values
    (by transformers' converter) into the reference model."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            ref = getattr(experts, proj)  # [E, in, out]
            E, k_in, n_out = ref.shape
            blocks = torch.randint(0, 256, (E, n_out, k_in // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(122, 126, (E, n_out, k_in // 32), dtype=torch.uint8, generator=gen)
            deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
            with torch.no_grad():
                ref.copy_(deq)
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def greedy_ids(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """ferryman's greedy tokens (n per prompt, eos ignored) for token-id prompts."""
    from ferryman import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]


def greedy_with_top2(llm, prompts: list[list[int]], n: int) -> list[list[tuple[int, list[tuple[int, float]]]]]:
    """Greedy decode stepping the engine: per prompt, per token (id, the top-2 (id, logprob))."""
    from ferryman import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    rids = [eng.add_request(p, params) for p in prompts]
    out: dict[int, list] = {r: [] for r in rids}
    while any(r in eng.requests for r in rids):
        for delta in eng.step():
            lp = delta.logprobs[0] if delta.logprobs else None
            out[delta.request_id].append((delta.token_ids[0], lp[1] if lp else []))
    for r in rids:
        eng.pop_output(r)
    return [out[r] for r in rids]


def agree_but_near_ties(got: list[list], want: list[list], tie: float) -> None:
    """Two greedy runs (greedy_with_top2) agree, except that a run may part from the other where
    both saw the two tokens within `tie` nats of each other (a rounding tie); after that the
    contexts differ and nothing more is compared."""
    for g_seq, w_seq in zip(got, want, strict=True):
        for i, ((g, g_top), (w, w_top)) in enumerate(zip(g_seq, w_seq)):
            if g == w:
                continue
            for top in (g_top, w_top):
                ids = [t for t, _ in top]
                assert {g, w} <= set(ids) and abs(top[0][1] - top[1][1]) < tie, (
                    f"token {i}: {g} against {w} is no near tie: top-2 {g_top} / {w_top}")
            break


def torch_delta_rule_in_transformers() -> None:
    """transformers' Qwen3-Next / Qwen3.5 call flash-linear-attention's Triton kernels in place of
    their torch gated delta rule whenever fla is importable, whatever the tensors' device: the CPU
    reference would hand CPU tensors to Triton. Put the modules' own torch functions back (the
    innermost of each wrapper chain, the function defined in the modeling file)."""
    import importlib
    import inspect

    for name in ("qwen3_next.modeling_qwen3_next", "qwen3_5_moe.modeling_qwen3_5_moe"):
        try:
            mod = importlib.import_module(f"transformers.models.{name}")
        except ImportError:
            continue
        for fn_name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            fn = getattr(mod, fn_name, None)
            if fn is not None:
                own = mod.__file__
                setattr(mod, fn_name, inspect.unwrap(fn, stop=lambda f: getattr(f, "__code__", None) is not None
                                                     and f.__code__.co_filename == own))


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    torch_delta_rule_in_transformers()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    torch_delta_rule_in_transformers()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def count_calls(obj: object, method: str, when=None) -> list[int]:  # noqa: ANN001
    """Wrap obj.<method> to count its calls in [0] (only those whose arguments pass `when`)."""
    calls = [0]
    inner = getattr(obj, method)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += int(when is None or when(*args, **kwargs))
        return inner(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


# ---- configs and calibration files for the hybrid-split tests -----------------------------------


def preset_config(name: str) -> ModelConfig:
    """A preset's config (dummy weights: nothing downloaded)."""
    from ferryman.models.registry import model_config
    from ferryman.weights.build import resolve_hf_config

    return model_config(resolve_hf_config(name, "dummy")[0])


def demo_config() -> ModelConfig:
    from ferryman.models.registry import model_config
    from ferryman.llm import default_model

    return model_config(default_model())


def calibration_of(cfg: ModelConfig, dtype: torch.dtype, link: float, cpu: float) -> Calibration:
    """A calibration for cfg's experts on this machine with the given rates (experts/s)."""
    from ferryman.calibrate.calibration import Calibration, Rate, expert_key, machine_info

    key = expert_key(cfg, dtype)
    return Calibration(key, machine_info(), cpu_compute=Rate.of(1 / cpu, key["expert_bytes"], 5),
                       host_copy=Rate.of(1 / link, key["row_bytes"], 5))
