"""Tiny checkpoints rewritten in the quantised layouts the releases use, with each layout's reference
dequantisation written out from its definition (transformers' FP8 integration, compressed-tensors'
`_dequantize`, modelopt's NVFP4 export), independently of ferryman's code.

`quantise_folder(folder, layout, ref_folder)` replaces every Linear weight of the saved tiny model by
its quantised parts (config.json gets the matching quantization_config) and writes the weights those
parts stand for, dequantised to fp32, as a plain checkpoint in `ref_folder` for transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
LAYOUTS = ("fp8_block", "fp8_tensor", "ct_fp8_channel", "ct_fp8_block", "modelopt_nvfp4", "ct_nvfp4")
SKIP = ("embed_tokens", "lm_head", "norm", ".gate.weight", "router")


def is_linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in SKIP)


# ---- references, from each definition ---------------------------------------------------------
def ref_fp8_block(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """transformers Fp8Dequantize: fp32(q) reshaped into blocks times the block's fp32 scale."""
    rows, cols = q.shape
    qf = q.to(torch.float32).reshape(rows // bn, bn, cols // bk, bk)
    return (qf * s.to(torch.float32)[:, None, :, None]).reshape(rows, cols)


def ref_ct_scale(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """compressed-tensors _dequantize: x_q.to(scale.dtype) * scale (channel [out, 1] / tensor [1])."""
    return q.to(s.dtype) * s


def ref_unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors unpack_fp4_from_uint8: low nibble first, sign bit 3."""
    low, high = packed & 0x0F, (packed >> 4) & 0x0F
    codes = torch.stack((low, high), dim=-1).flatten(-2).long()
    return E2M1[codes]


def ref_nvfp4(packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, divide: bool) -> torch.Tensor:
    """modelopt: code * (fp32(scale) * weight_scale_2); compressed-tensors: code * (fp32(scale) / global)."""
    vals = ref_unpack_e2m1(packed).unflatten(-1, (-1, 16))
    eff = scale.to(torch.float32) / g if divide else scale.to(torch.float32) * g
    return (vals * eff[..., None]).flatten(-2)


# ---- quantisers (any valid encoding will do: the references define what it means) -------------
def _fp8_codes(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)


def q_fp8_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    blocks = w.reshape(rows // bn, bn, cols // bk, bk)
    s = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-8)  # [rows/bn, cols/bk]
    return _fp8_codes(blocks, s[:, None, :, None]).reshape(rows, cols), s


def q_nvfp4(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Random codes near w's magnitude: packed [out, k/2], e4m3 scales [out, k/16], global (multiplier)."""
    out, k = w.shape
    g = float(w.abs().max()) / (448.0 * 6.0)
    amax = w.unflatten(-1, (-1, 16)).abs().amax(-1)  # [out, k/16]
    scale = (amax / 6.0 / g).clamp(1e-3, 448).to(torch.float8_e4m3fn)
    codes = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale, g


def quantise(name: str, w: torch.Tensor, layout: str, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint parts of `name`, the fp32 weight they stand for by the layout's reference)."""
    m = name[: -len("weight")]
    if layout in ("fp8_block", "ct_fp8_block"):
        q, s = q_fp8_block(w, 16, 16)
        scale_name = "weight_scale_inv" if layout == "fp8_block" else "weight_scale"
        return {m + "weight": q, m + scale_name: s}, ref_fp8_block(q, s, 16, 16)
    if layout == "fp8_tensor":
        s = (w.abs().max() / 448.0).reshape(())
        q = _fp8_codes(w, s)
        return {m + "weight": q, m + "weight_scale_inv": s}, q.to(torch.float32) * s
    if layout == "ct_fp8_channel":
        # fp32 scales: compressed-tensors multiplies in the scale's dtype, so bf16 scales would round
        # the product to bf16 before an fp32 model sees it (test_fp8_nvfp4.py checks bf16 scales in bf16)
        s = w.abs().amax(dim=1, keepdim=True) / 448.0  # [out, 1]
        q = _fp8_codes(w, s)
        return {m + "weight": q, m + "weight_scale": s}, ref_ct_scale(q, s).to(torch.float32)
    packed, scale, g = q_nvfp4(w, gen)
    if layout == "modelopt_nvfp4":
        g2 = torch.tensor(g, dtype=torch.float32)
        return ({m + "weight": packed, m + "weight_scale": scale, m + "weight_scale_2": g2,
                 m + "input_scale": torch.tensor(1.0)}, ref_nvfp4(packed, scale, g2, divide=False))
    gs = torch.tensor([1.0 / g], dtype=torch.float32)
    return ({m + "weight_packed": packed, m + "weight_scale": scale, m + "weight_global_scale": gs},
            ref_nvfp4(packed, scale, gs, divide=True))


def quant_config(layout: str) -> dict:
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]
    if layout == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    if layout == "fp8_tensor":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": None}
    if layout.startswith("ct_fp8"):
        strategy = "block" if layout == "ct_fp8_block" else "channel"
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = [16, 16]
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "float-quantized"}}}
    if layout == "modelopt_nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ["lm_head", "*.mlp.gate", "*block_sparse_moe.gate"]}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "nvfp4-pack-quantized"}}}


def quantise_folder(folder: Path, layout: str, ref_folder: Path, seed: int = 0) -> None:
    """Rewrite the checkpoint in `folder` in `layout`; `ref_folder`: a copy holding the weights the
    parts stand for, dequantised to fp32 (load it with transformers)."""
    gen = torch.Generator().manual_seed(seed)
    shutil.copytree(folder, ref_folder, dirs_exist_ok=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    packed, plain = {}, {}
    for name, t in tensors.items():
        if is_linear(name, t):
            parts, ref = quantise(name, t.float(), layout, gen)
            packed.update(parts)
            plain[name] = ref.contiguous()
        else:
            packed[name], plain[name] = t, t
    save_file(packed, str(file), metadata={"format": "pt"})
    save_file(plain, str(ref_folder / file.name), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quant_config(layout)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
