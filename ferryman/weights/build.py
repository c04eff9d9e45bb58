"""Resolve a model argument (folder, GGUF file or preset), build the module tree and the expert store, load weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ferryman.config import ModelConfig, dtype_from_str
from ferryman.errors import ConfigError, ModelLoadError
from ferryman.experts.store import ExpertStore
from ferryman.models.registry import get_architecture, model_config, read_config_json
from ferryman.models.transformer import MoETransformer
from ferryman.quant.hf_quant import with_quantization
from ferryman.weights.gguf_config import gguf_model_config
from ferryman.weights.gguf_file import GGUFModel, is_gguf_path
from ferryman.weights.gguf_load import load_gguf_weights
from ferryman.weights.int_source import int_source
from ferryman.weights.loader import load_weights
from ferryman.weights.presets import PRESETS, get_preset, is_preset
from ferryman.weights.quantised import quantised_linears
from ferryman.weights.sources import DummySource, SafetensorsSource, TensorSource

@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: MoETransformer
    store: ExpertStore
    folder: Path | None  # None for presets (no tokenizer files); a GGUF model's config_folder
    gguf: GGUFModel | None = None  # the GGUF model the weights came from


@dataclass(frozen=True)
class ResolvedModel:
    """What a model argument names: its ModelConfig, its folder (HF, or a GGUF's config_folder),
    and the GGUF model when it is one."""

    cfg: ModelConfig
    folder: Path | None
    gguf: GGUFModel | None
    hf: dict = field(default_factory=dict)  # the config.json dict (quantization_config included); {} for GGUF


def resolve_model(model: str, load_format: str = "auto", config_folder: str | None = None,
                  quantization: str | None = None) -> ResolvedModel:
    """A model folder, a preset, or a GGUF file / split set / folder holding one. config_folder: a
    Hugging Face folder whose config.json (and tokenizer) replace the GGUF metadata's;
    quantization: `--quantization` (dummy weights only; a GGUF file's formats are its own)."""
    if is_gguf_path(model):
        if quantization not in (None, "none", "auto"):
            raise ConfigError(f"quantization={quantization!r} does not apply to GGUF models: {model} "
                              f"holds its own formats")
        g = GGUFModel(model)
        folder = Path(config_folder).expanduser() if config_folder else None
        if folder is not None and not folder.is_dir():
            raise ModelLoadError(f"config folder {folder} does not exist")
        with_config = folder if folder is not None and (folder / "config.json").exists() else None
        return ResolvedModel(gguf_model_config(g, with_config), folder, g)
    if config_folder:
        raise ConfigError(f"config_folder applies to GGUF models; {model} is not a .gguf file")
    hf, folder = resolve_hf_config(model, load_format, quantization)
    return ResolvedModel(model_config(hf), folder, None, hf)


def resolve_hf_config(model: str, load_format: str, quantization: str | None = None) -> tuple[dict, Path | None]:
    """(config.json dict, model folder or None for a preset); `quantization`: `--quantization`,
    applied to dummy weights (quant/hf_quant.py `with_quantization`)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is not a folder; pass the model folder holding config.json")
        hf = with_modelopt_file(read_config_json(path), path)
        return with_quantization(hf, quantization, load_format == "dummy"), path
    if is_preset(model):
        if load_format != "dummy":
            raise ModelLoadError(
                f"{model!r} is a built-in preset without weights; add --load-format dummy "
                f"to run it with random weights, or pass a model folder"
            )
        return with_quantization(get_preset(model), quantization, True), None
    raise ModelLoadError(f"model folder {path} does not exist (and {model!r} is not a built-in preset: "
                         f"{', '.join(PRESETS)})")


def with_modelopt_file(hf: dict, folder: Path) -> dict:
    """A modelopt export keeps its quantisation in hf_quant_config.json when config.json lacks it."""
    extra = folder / "hf_quant_config.json"
    if hf.get("quantization_config") or not extra.exists():
        return hf
    try:
        data = json.loads(extra.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{extra} is not valid JSON: {e}") from None
    return {**hf, "quantization_config": {"quant_method": "modelopt", **data}}


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    return cfg.dtype if dtype == "auto" else dtype_from_str(dtype)


def build_model(
    model: str,
    device: torch.device,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = False,
    quantization: str | None = None,
    store_factory: Callable[[ModelConfig, torch.dtype, torch.device], ExpertStore] | None = None,
    host_embedding: bool = False,
    config_folder: str | None = None,
    resolved: ResolvedModel | None = None,
) -> LoadedModel:
    """store_factory: where routed experts live (experts/placement.py); default: on `device`.
    host_embedding: keep the token-embedding table in host RAM (an offloaded plan's choice).
    config_folder: see `resolve_model`; resolved: `resolve_model`'s answer, if the caller has it."""
    resolved = resolved or resolve_model(model, load_format, config_folder, quantization)
    cfg, folder = resolved.cfg, resolved.folder
    if resolved.gguf is not None and load_format not in ("auto", "gguf"):
        raise ConfigError(f"{model} is a GGUF model: load_format must be auto or gguf, got {load_format!r}")
    arch = get_architecture(cfg.model_type)
    torch_dtype = resolve_dtype(dtype, cfg)
    net = _instantiate(cfg, torch_dtype, device, cfg.max_position_embeddings, host_embedding and not cfg.tie_word_embeddings)
    store = (store_factory or ExpertStore)(cfg, torch_dtype, device)
    if resolved.gguf is not None:
        load_gguf_weights(net, store, arch, cfg, resolved.gguf, progress=progress)
        return LoadedModel(cfg, net.eval(), store, folder, resolved.gguf)
    source: TensorSource
    if load_format == "dummy":
        schema = arch.checkpoint_tensors(cfg)
        quant = quantised_linears(arch, cfg, schema)
        parts = None
        if quant is not None:
            schema = quant.schema
            parts = lambda name: quant.random(name, seed, device) if name in quant.weight_of else None  # noqa: E731
        source = DummySource(schema, cfg.hidden_size, seed, device, parts)
    else:
        assert folder is not None  # presets were rejected above without dummy weights
        source = SafetensorsSource(folder)
    source = int_source(source, resolved.hf, cfg, arch, load_format == "dummy", seed, device)
    load_weights(net, store, arch, cfg, source, progress=progress)
    return LoadedModel(cfg, net.eval(), store, folder)


def _instantiate(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, positions: int,
                 host_embedding: bool = False) -> MoETransformer:
    """Build on the meta device (no init cost), then allocate uninitialised storage on `device`
    (the token-embedding table in host RAM with host_embedding: it never touches the device)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            net = MoETransformer(cfg, positions)
    finally:
        torch.set_default_dtype(previous)
    table = net.embed_tokens if host_embedding else None
    if table is not None:
        net.embed_tokens = None  # type: ignore[assignment]  # left out of the device move
    net = net.to_empty(device=device)
    if table is not None:
        net.embed_tokens = table.to_empty(device="cpu")
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters
        net.lm_head.weight = net.embed_tokens.weight
    net.rotary.build(device)
    return net
