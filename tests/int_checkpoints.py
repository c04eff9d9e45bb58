"""Integer checkpoints written the way their producers write them, independently of ferryman's code:
compressed-tensors pack-quantized (pack_to_int32: value + 2^(bits-1), input i at bits i * bits of its
word; zero points packed along the output dim), AutoAWQ's GEMM packing (AWQ_ORDER), GPTQ (qweight
packed along the input dim, qzeros minus one, g_idx). Each writer quantises an fp32 weight [out, K]
and returns its checkpoint tensors and the reference dequantised fp32 weight, computed element by
element from the formula w = (q - z) * s of each format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantise(w: torch.Tensor, bits: int, group: int, sym: bool, gidx: torch.Tensor,
             scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, K] -> (q [out, K] unsigned codes, s [out, G] in scale_dtype, z [out, G] unsigned zeros);
    gidx [K]: the group of each input. Min-max rounding, as the producers' default observers."""
    out, k = w.shape
    groups = int(gidx.max()) + 1
    top = (1 << bits) - 1
    s = torch.empty(out, groups)
    z = torch.empty(out, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, gidx == g]
        if sym:
            s[:, g] = cols.abs().amax(1) / ((top + 1) // 2 - 1)
            z[:, g] = (top + 1) // 2
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, g] = (hi - lo) / top
            z[:, g] = (-lo / s[:, g]).round().clamp(0, top).long()
    s = s.to(scale_dtype)
    sf = s.float()[:, gidx]
    q = (w / sf).round().long() + z[:, gidx]
    return q.clamp(0, top), s, z


def reference(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gidx: torch.Tensor) -> torch.Tensor:
    """(q - z) * s, input k taking group gidx[k]'s scale and zero, in fp32."""
    return (q - z[:, gidx]).float() * s.float()[:, gidx]


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def pack_along(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned values along `dim` into int32 words: word j's slot i holds index
    j*P + order[i] (order: identity, or AWQ's)."""
    p = 32 // bits
    v = values.long().movedim(dim, -1)
    order = order or list(range(p))
    words = torch.zeros(*v.shape[:-1], v.shape[-1] // p, dtype=torch.int64)
    for i in range(p):
        words |= v[..., order[i]::p] << (bits * i)
    return _to_int32(words).movedim(-1, dim).contiguous()


def ct_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, act: bool = False,
               gen: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, k = w.shape
    gidx = _gidx(k, group, act, gen)
    q, s, z = quantise(w, bits, group, sym, gidx, torch.bfloat16)
    t = {"weight_packed": pack_along(q, bits, 1), "weight_scale": s,
         "weight_shape": torch.tensor([out, k], dtype=torch.int32)}
    if not sym:
        t["weight_zero_point"] = pack_along(z, bits, 0)  # signed zero + 2^(bits-1), packed along out
    if act:
        t["weight_g_idx"] = gidx.int()
    return t, reference(q, s, z, gidx)


def awq_tensors(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, k = w.shape
    gidx = torch.arange(k) // group
    q, s, z = quantise(w, 4, group, False, gidx, torch.float16)
    t = {"qweight": pack_along(q.T, 4, 1, AWQ_ORDER), "qzeros": pack_along(z.T, 4, 1, AWQ_ORDER),
         "scales": s.T.contiguous()}
    return t, reference(q, s, z, gidx)


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, act: bool,
                 gen: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, k = w.shape
    gidx = _gidx(k, group, act, gen)
    q, s, z = quantise(w, bits, group, sym, gidx, torch.float16)
    stored = (z - 1) & ((1 << bits) - 1)  # GPTQ (v1) stores zero - 1, a zero of 0 wrapping to 2^bits - 1
    t = {"qweight": pack_along(q.T, bits, 0), "qzeros": pack_along(stored.T, bits, 1), "scales": s.T.contiguous(),
         "g_idx": gidx.int()}
    return t, reference(q, s, stored + 1, gidx)  # GPTQ's kernels subtract stored + 1


def _gidx(k: int, group: int, act: bool, gen: torch.Generator | None) -> torch.Tensor:
    if not act:
        return torch.arange(k) // (group or k)
    perm = torch.randperm(k, generator=gen)
    gidx = torch.empty(k, dtype=torch.long)
    gidx[perm] = torch.arange(k) // group
    return gidx


# layout name -> (quantization_config, writer of one linear)
LAYOUTS = {
    "ct_int4_group_sym": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                               "group_size": 16}}}},
                          lambda w, g: ct_tensors(w, 4, 16, True)),
    "ct_int4_asym": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                          "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                          "group_size": 16}}}},
                     lambda w, g: ct_tensors(w, 4, 16, False)),
    "ct_int8_channel": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                             "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}},
                        lambda w, g: ct_tensors(w, 8, 0, True)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": ["mlp.gate", "block_sparse_moe.gate"]},
            lambda w, g: awq_tensors(w, 16)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True},
             lambda w, g: gptq_tensors(w, 4, 16, True, False)),
    "gptq_desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False},
                      lambda w, g: gptq_tensors(w, 4, 16, False, True, g)),
}


def _quantised(name: str) -> bool:
    return name.endswith(".weight") and ".layers." in name and "norm" not in name \
        and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))


def write_int_checkpoint(src: Path, layout: str, dst: Path, ref_dst: Path, seed: int = 0) -> None:
    """src: a plain tiny checkpoint (tiny_models.build_tiny). dst: every decoder linear but the router
    packed in `layout`; ref_dst: the same folder with the dequantised fp32 weights (for transformers)."""
    qc, write = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    (file,) = src.glob("*.safetensors")
    tensors = load_file(str(file))
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _quantised(name):
            packed[name] = plain[name] = t
            continue
        parts, deq = write(t.float(), gen)
        prefix = name.removesuffix("weight")
        packed.update({prefix + k: v for k, v in parts.items()})
        plain[name] = deq.to(t.dtype)
    cfg = json.loads((src / "config.json").read_text())
    for folder, ts, conf in ((dst, packed, dict(cfg, quantization_config=qc)), (ref_dst, plain, cfg)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(conf, indent=2))
        for extra in src.glob("generation_config.json"):
            (folder / extra.name).write_text(extra.read_text())
