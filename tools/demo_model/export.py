"""Write the trained model as a Hugging Face folder: bf16 safetensors, config, generation config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import Qwen3MoeForCausalLM

from tools.demo_model.config import MAX_SAFETENSORS_BYTES, ModelSpec, safetensors_names

WEIGHTS_FILE = "model.safetensors"


def export_model(model: Qwen3MoeForCausalLM, out: Path, stop_token_ids: list[int], spec: ModelSpec) -> int:
    """Save bf16 weights + config.json (with the served context, `spec.served_rope`) +
    generation_config.json; returns the weights file size.

    The model is moved to CPU bf16 in place (training is over by then).
    """
    model.to(device="cpu", dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, max_shard_size="100GB")
    weights = out / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"save_pretrained did not write a single {WEIGHTS_FILE} in {out}")
    check_tensor_names(weights, safetensors_names(model.config))
    size = weights.stat().st_size
    if size > MAX_SAFETENSORS_BYTES:
        raise ValueError(f"{weights} is {size / 2**20:.2f} MiB, over {MAX_SAFETENSORS_BYTES / 2**20:.0f} MiB")
    set_served_context(out / "config.json", spec)
    add_legacy_config_keys(out / "config.json")
    write_generation_config(out / "generation_config.json", stop_token_ids, model.config.pad_token_id)
    for path in out.iterdir():
        path.chmod(0o644)  # save_pretrained may write 0600 files
    return size


def check_tensor_names(weights: Path, expected: list[str]) -> None:
    """The file must use the canonical per-expert Qwen3-MoE names that ferryman's loader reads."""
    with safe_open(str(weights), framework="pt") as f:
        found = sorted(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in found}
    if found != expected:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise ValueError(f"{weights} has unexpected tensor names: missing {missing[:5]}, extra {extra[:5]}")
    if dtypes != {"BF16"}:
        raise ValueError(f"{weights} holds dtypes {sorted(dtypes)}, expected only BF16")


def set_served_context(path: Path, spec: ModelSpec) -> None:
    """Training ran with plain RoPE over short windows; the exported model serves
    `spec.served_context` positions through YaRN (as Qwen3 models extend theirs)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["rope_parameters"] = spec.served_rope()
    config["max_position_embeddings"] = spec.served_context
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_legacy_config_keys(path: Path) -> None:
    """Also write the keys transformers 4.x and most other readers look for.

    transformers 5 writes `dtype`, `rope_parameters` and `num_local_experts`; 4.x reads
    `torch_dtype`, `rope_theta` and `num_experts` (and would silently fall back to its defaults,
    e.g. rope_theta 1e6, without them). The values are copies, so both readings agree.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["num_experts"] = config.get("num_local_experts", config.get("num_experts"))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_generation_config(path: Path, stop_token_ids: list[int], pad_token_id: int) -> None:
    """Greedy by default; generation stops at <|endoftext|> or <|im_end|>."""
    config = {
        "do_sample": False,
        "eos_token_id": stop_token_ids,
        "pad_token_id": pad_token_id,
        "transformers_version": transformers.__version__,
    }
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
