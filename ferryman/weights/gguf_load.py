"""Fill a `MoETransformer` and an `ExpertStore` from a GGUF model.

Dense tensors (attention, norms, embeddings, router, dense and shared MLPs) are dequantised with
gguf-py to fp32, then cast to the model dtype by the parameter copy, and placed through the
architecture's own `map_name` (their llama.cpp names translated in weights/gguf_names.py). Routed
experts keep their blocks: each layer's `ffn_{gate,up,down}_exps` bytes are copied once, straight
from the memory map, into the store's banks in the layer's format (`ModelConfig.expert_format_of`):
`gguf:*` banks take the rows as they are, MXFP4 is repacked losslessly into ferryman's `mxfp4`, float
experts become `dense` banks. After a tensor is copied its pages are dropped from the mapping, so
the process holds about one copy of the model at the end (the page cache keeps the file).

Invariant: after `load_gguf_weights` returns, every parameter and every expert bank slice has been
written from the file; anything missing or mis-shaped raised a WeightError naming the tensor first.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from ferryman.config import ModelConfig
from ferryman.errors import WeightError
from ferryman.experts.store import ExpertStore
from ferryman.models.base import Architecture
from ferryman.quant.gguf_blocks import dequant_rows, ggml_mxfp4_to_blocks_scales, rows_from_numpy
from ferryman.weights.gguf_file import GGUFModel
from ferryman.weights.gguf_names import EXPERTS, hf_name, unpermute_rope
from ferryman.weights.loader import write_param

PROJ = ("gate", "up", "down")


def as_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only, memory-mapped) numpy array; never written through."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the view is only read
        return torch.from_numpy(arr)


CHUNK_ROWS = 2048  # rows dequantised at once: its fp32 temporaries (tens of MiB) stay small beside the model


def dequantized(g: GGUFModel, name: str, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", into: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of any supported type -> `dtype` on `device`, in torch order ([rows, cols] for a
    matrix), through quant/gguf_blocks.py's dequantiser (gguf-py's values bit for bit on the CPU), a
    chunk of rows at a time; on CUDA the blocks travel and the device dequantises them. into: a
    contiguous tensor of the same shape to fill instead (no second copy of a large table)."""
    gtype = g.type_name(name).lower()
    raw = rows_from_numpy(g.raw(name), gtype)  # [rows, row_bytes], the memory map
    if into is not None:
        out, device = into.view(raw.shape[0], -1), into.device
    else:
        out = torch.empty((raw.shape[0], g.shape(name)[-1]), dtype=dtype, device=device)
    for start in range(0, raw.shape[0], CHUNK_ROWS):
        out[start : start + CHUNK_ROWS] = dequant_rows(raw[start : start + CHUNK_ROWS].to(device), gtype)
    return out.reshape(g.shape(name))


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]loading GGUF"), BarColumn(), DownloadColumn(binary_units=True),
                    TimeRemainingColumn(), disable=not enabled, transient=True)


def load_gguf_weights(model: nn.Module, store: ExpertStore, arch: Architecture, cfg: ModelConfig, g: GGUFModel,
                      progress: bool = False) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    written: set[str] = set()
    experts: set[tuple[int, str, str]] = set()  # (layer, gate|up|down, weight|bias) copied
    with torch.no_grad(), _progress(progress) as bar:
        task = bar.add_task("load", total=sum(int(t.n_bytes) for t in g.tensors.values()))
        for name, t in g.tensors.items():
            m = EXPERTS.match(name)
            if m is not None and int(m.group(1)) in store.banks:
                layer = int(m.group(1))
                write_experts(store, cfg, g, name, layer, m.group(2), m.group(3))
                experts.add((layer, m.group(2), m.group(3)))
            else:
                _write_dense(params, written, arch, cfg, g, name)
            g.release(name)
            bar.advance(task, int(t.n_bytes))
    _check_complete(params, written, experts, cfg, g)


def _write_dense(params: dict[str, nn.Parameter], written: set[str], arch: Architecture, cfg: ModelConfig,
                 g: GGUFModel, name: str) -> None:
    hf = hf_name(name, cfg.model_type)
    target = arch.map_name(cfg, hf) if hf is not None else None
    if target is None or target.kind != "param":
        return  # a tensor ferryman has no use for (rope_freqs, multi-token-prediction layers, ...)
    dst = params.get(target.name)
    permuted = g.arch == "llama" and hf is not None and hf.endswith(("q_proj.weight", "k_proj.weight"))
    if dst is not None and target.rows is None and not permuted and dst.is_contiguous() \
            and tuple(dst.shape) == g.shape(name):
        dequantized(g, name, into=dst.data)  # straight into the parameter
        written.add(target.name)
        return
    tensor = dequantized(g, name, dst.dtype, dst.device) if dst is not None else dequantized(g, name)
    if permuted:
        heads = cfg.num_heads if hf.endswith("q_proj.weight") else cfg.num_kv_heads
        tensor = unpermute_rope(tensor, heads)
    write_param(params, target.name, target.rows, tensor, name, g.file_of(name))
    written.add(target.name)


def _rows(proj: str, inter: int, interleaved: bool) -> slice:
    """Rows of w13 holding gate or up: [0, I) / [I, 2I), or even / odd rows for gpt-oss's interleaved SwiGLU."""
    if interleaved:
        return slice(0 if proj == "gate" else 1, 2 * inter, 2)
    return slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)


def write_experts(store: ExpertStore, cfg: ModelConfig, g: GGUFModel, name: str, layer: int, proj: str,
                  kind: str) -> None:
    """Copy one `ffn_{proj}_exps` tensor (all experts of `layer`) into the layer's banks."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    banks = store.banks[layer]
    want = ((E, I, H) if proj != "down" else (E, H, I)) if kind == "weight" else ((E, I) if proj != "down" else (E, H))
    if g.shape(name) != want:
        raise WeightError(name, g.file_of(name), expected=want, actual=g.shape(name))
    w = "w2" if proj == "down" else "w13"
    rows = slice(None) if proj == "down" else _rows(proj, I, cfg.expert_act == "swiglu_oai")
    if kind == "bias":
        if f"{w}_bias" not in banks:
            raise WeightError(name, g.file_of(name), reason="expert biases in a model without them")
        banks[f"{w}_bias"][:, rows].copy_(dequantized(g, name, banks[f"{w}_bias"].dtype))
        return
    fmt = cfg.expert_format_of(layer)
    if fmt == "dense":
        banks[w][:, rows].copy_(dequantized(g, name, banks[w].dtype))
    elif fmt == "mxfp4":
        blocks, scales = ggml_mxfp4_to_blocks_scales(as_torch(g.raw(name)))
        banks[f"{w}_blocks"][:, rows].copy_(blocks)
        banks[f"{w}_scales"][:, rows].copy_(scales)
    else:  # gguf:<w13>:<w2>: the rows of blocks as the file holds them
        dst = banks[f"{w}_q"][:, rows]
        src = as_torch(g.raw(name))
        if tuple(src.shape) != tuple(dst.shape):
            raise WeightError(name, g.file_of(name), expected=dst.shape, actual=src.shape,
                              reason=f"block bytes do not fit the {fmt} bank")
        dst.copy_(src)


def _check_complete(params: dict[str, nn.Parameter], written: set[str], experts: set[tuple[int, str, str]],
                    cfg: ModelConfig, g: GGUFModel) -> None:
    if cfg.tie_word_embeddings:
        written.add("lm_head.weight")
    unfilled = [n for n in params if n not in written]
    if unfilled:
        raise WeightError(unfilled[0], str(g.path), reason="parameter got no GGUF tensor "
                          f"({len(unfilled)} missing; is this file of the architecture its metadata names?)")
    kinds = ("weight", "bias") if cfg.expert_bias else ("weight",)
    for layer in cfg.moe_layers:
        for proj in PROJ:
            for kind in kinds:
                if (layer, proj, kind) not in experts:
                    raise WeightError(f"blk.{layer}.ffn_{proj}_exps.{kind}", str(g.path),
                                      reason="missing from the file")
