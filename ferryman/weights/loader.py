"""Fill a `MoETransformer` and an `ExpertStore` from a tensor source.

Invariant: after `load_weights` returns, every parameter of the module tree and every expert bank
slice has been written exactly from the checkpoint (or the dummy generator); anything missing or
mis-shaped raised a `WeightError` naming the tensor and its file first.
"""

from __future__ import annotations

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from ferryman.config import ModelConfig
from ferryman.errors import WeightError
from ferryman.experts.store import ExpertStore
from ferryman.models.base import Architecture
from ferryman.weights.quantised import QuantisedLinears, quantised_linears
from ferryman.weights.sources import DummySource, TensorSource


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]loading weights"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tensors"),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=True,
    )


def load_weights(
    model: nn.Module,
    store: ExpertStore,
    arch: Architecture,
    cfg: ModelConfig,
    source: TensorSource,
    progress: bool = False,
) -> None:
    available = source.names()
    schema = arch.checkpoint_tensors_in(cfg, available)
    quant = quantised_linears(arch, cfg, schema, None if isinstance(source, DummySource) else available)
    if quant is not None:  # each quantised Linear's weight is its layout's parts
        schema = quant.schema
    missing = [n for n in schema if n not in available]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightError(missing[0], source.file_of(missing[0]), reason=f"missing from the checkpoint{more}")
    params = dict(model.named_parameters(remove_duplicate=False))
    written: set[str] = set()
    with torch.no_grad(), _progress(progress) as bar:
        task = bar.add_task("load", total=len(schema))
        for name, (shape, _) in schema.items():
            if quant is not None and name in quant.weight_of:
                if quant.first_part(name):
                    _load_quantised(quant, quant.weight_of[name], params, store, arch, cfg, source, written)
                bar.advance(task)
                continue
            actual = source.shape(name)
            if tuple(actual) != tuple(shape):
                raise WeightError(name, source.file_of(name), expected=shape, actual=actual)
            target = arch.map_name(cfg, name)
            if target is None:
                raise WeightError(name, source.file_of(name), reason="no place in the model for this tensor")
            tensor = source.get(name)
            if target.kind == "expert":
                store.write(target, tensor, name, source.file_of(name))
            else:
                write_param(params, target.name, target.rows, tensor, name, source.file_of(name))
                written.add(target.name)
            bar.advance(task)
    if cfg.tie_word_embeddings:
        written.add("lm_head.weight")  # shares embed_tokens' tensor
    unfilled = [n for n in params if n not in written]
    if unfilled:
        raise WeightError(unfilled[0], source.file_of(unfilled[0]), reason="parameter got no checkpoint tensor")


def _load_quantised(quant: QuantisedLinears, weight: str, params: dict[str, nn.Parameter], store: ExpertStore,
                    arch: Architecture, cfg: ModelConfig, source: TensorSource, written: set[str]) -> None:
    """One quantised Linear: a routed expert's parts into its banks, packed; any other weight
    dequantised (fp32, as the formats' references compute it) into its parameter."""
    file = source.file_of(next(iter(quant.parts[weight].values())))
    target = arch.map_name(cfg, weight)
    if target is None:
        raise WeightError(weight, file, reason="no place in the model for this tensor")
    parts = quant.read(weight, source)
    if target.kind == "expert":
        for bank_target, part_name, tensor in quant.expert_writes(weight, target, parts):
            store.write(bank_target, tensor, part_name, source.file_of(part_name))
        return
    write_param(params, target.name, target.rows, quant.dequant(weight, parts, torch.float32, file), weight, file)
    written.add(target.name)


def write_param(
    params: dict[str, nn.Parameter],
    pname: str,
    rows: tuple[int, int] | None,
    tensor: torch.Tensor,
    name: str,
    file: str,
) -> None:
    if pname not in params:
        raise WeightError(name, file, reason=f"maps to {pname}, which the model does not have")
    dst = params[pname].data
    if rows is not None:
        dst = dst[rows[0] : rows[1]]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise WeightError(name, file, expected=dst.shape, actual=tensor.shape)
    dst.copy_(tensor.to(dst.dtype))
