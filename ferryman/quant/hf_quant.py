"""`quantization_config` -> `QuantConfig`: one table from (quant_method, scheme) to a reader.

The scheme is what picks the layout inside a method: compressed-tensors' `format` (the config
groups', or the top-level one), modelopt's `quant_algo`, "" for methods of one layout (fp8, mxfp4,
awq, gptq). A reader takes the whole `quantization_config` dict and returns the `QuantConfig`
(the routed experts' format, the checkpoint layout of each quantised Linear, the ignore list), or
raises ConfigError naming the field. A new method is one reader and one line in `READERS`.

`DUMMY_CONFIGS` are the `quantization_config`s that `--quantization NAME` gives a dummy model.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from typing import Any

from ferryman.config import QuantConfig
from ferryman.errors import ConfigError
from ferryman.quant.intq_schemes import DUMMY_CONFIGS as INT_DUMMY_CONFIGS
from ferryman.quant.intq_schemes import int_expert_format

Reader = Callable[[dict[str, Any]], QuantConfig]


def scheme_of(qc: dict[str, Any]) -> tuple[str, str]:
    """(quant_method, scheme) of a quantization_config."""
    method = str(qc.get("quant_method", "?"))
    if method == "compressed-tensors":
        return method, ct_format(qc)
    if method == "modelopt":
        return method, str(modelopt_fields(qc).get("quant_algo", "?"))
    return method, ""


def ct_format(qc: dict[str, Any]) -> str:
    """The one compression format of a compressed-tensors config (its groups' when they say)."""
    groups = qc.get("config_groups") or {}
    formats = {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
    if len(formats) > 1:
        raise ConfigError(f"quantization_config.config_groups mix formats {sorted(formats)}: one format per model "
                          f"is supported")
    return formats.pop() if formats else str(qc.get("format") or "?")


def modelopt_fields(qc: dict[str, Any]) -> dict[str, Any]:
    """modelopt configs come flat (config.json) or with a nested "quantization" (hf_quant_config.json)."""
    nested = qc.get("quantization")
    return {**qc, **nested} if isinstance(nested, dict) else qc


# ---- ignore lists: every dialect is turned into exact names and "re:" patterns ---------------
def ignore_exact_or_re(entries: Iterable[str] | None) -> tuple[str, ...]:
    """compressed-tensors: exact module names, or "re:" + a regex matched at the name's start."""
    return tuple(str(e) for e in entries or ())


def ignore_transformers(entries: Iterable[str] | None) -> tuple[str, ...]:
    """transformers' modules_to_not_convert (`should_convert_module`): an entry matches a module
    name as a regex from its start up to a module boundary ("mlp.gate" is not "mlp.gate_proj"), or
    as a suffix of it."""
    out: list[str] = []
    for e in entries or ():
        out += [rf"re:(?:{e})(?:(?<=\.)|(?=\.|$))", "re:.*" + re.escape(str(e)) + "$"]
    return tuple(out)


def ignore_globs(entries: Iterable[str] | None) -> tuple[str, ...]:
    """modelopt's exclude_modules: shell-style patterns over the module name."""
    return tuple("re:" + fnmatch.translate(str(e)) for e in entries or ())


def is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """Whether `module` (a name without ".weight") is left unquantised by `ignore`."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif entry == module:
            return True
    return False


# ---- the readers -------------------------------------------------------------------------------
def read_fp8(qc: dict[str, Any]) -> QuantConfig:
    """transformers' FP8 (DeepSeek-V3, Kimi-K2, Qwen3-FP8, GLM-4.5-FP8, MiniMax-M2): e4m3 weights
    times `weight_scale_inv`, per [bn, bk] block with `weight_block_size`, else per tensor."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r}: only e4m3 FP8 weights are supported")
    ignore = ignore_transformers(qc.get("modules_to_not_convert"))
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "fp8:channel", "fp8:tensor:weight_scale_inv", ignore)
    bn, bk = _pair(block, "quantization_config.weight_block_size")
    return QuantConfig("fp8", f"fp8:{bn}x{bk}", f"fp8:block-{bn}x{bk}:weight_scale_inv", ignore)


def read_ct_float(qc: dict[str, Any]) -> QuantConfig:
    """compressed-tensors float-quantized: FP8 e4m3 weights times `weight_scale`, per tensor,
    output channel or [bn, bk] block."""
    w = ct_weights(qc)
    if w.get("num_bits") != 8 or w.get("type", "float") != "float":
        raise ConfigError(f"compressed-tensors float-quantized weights of {w.get('num_bits')} bits, type "
                          f"{w.get('type')!r}: only 8-bit float (FP8) is supported")
    strategy = w.get("strategy", "tensor")
    ignore = ignore_exact_or_re(qc.get("ignore"))
    if strategy == "block":
        bn, bk = _pair(w.get("block_structure"), "weights.block_structure")
        return QuantConfig("compressed-tensors", f"fp8:{bn}x{bk}", f"fp8:block-{bn}x{bk}:weight_scale", ignore)
    if strategy in ("tensor", "channel"):
        return QuantConfig("compressed-tensors", "fp8:channel", f"fp8:{strategy}:weight_scale", ignore)
    raise ConfigError(f"compressed-tensors FP8 weights.strategy {strategy!r}: supported are tensor, channel, block")


def read_ct_nvfp4(qc: dict[str, Any]) -> QuantConfig:
    """compressed-tensors nvfp4-pack-quantized: `weight_packed` e2m1, `weight_scale` e4m3 per 16
    values, divided by `weight_global_scale`."""
    w = ct_weights(qc)
    if w.get("num_bits") != 4 or w.get("group_size", 16) != 16:
        raise ConfigError(f"compressed-tensors nvfp4 weights: expected 4 bits in groups of 16, got "
                          f"{w.get('num_bits')} bits, group_size {w.get('group_size')}")
    return QuantConfig("compressed-tensors", "nvfp4-ct", "nvfp4:ct", ignore_exact_or_re(qc.get("ignore")))


def read_modelopt_nvfp4(qc: dict[str, Any]) -> QuantConfig:
    """modelopt NVFP4 (NVIDIA's releases): `weight` e2m1 pairs, `weight_scale` e4m3 per 16 values,
    times `weight_scale_2`; `input_scale` (activations) is not used by W4A16 compute."""
    f = modelopt_fields(qc)
    if f.get("group_size", 16) != 16:
        raise ConfigError(f"modelopt NVFP4 group_size {f.get('group_size')}: expected 16")
    ignore = ignore_globs(f.get("exclude_modules") or f.get("ignore"))
    return QuantConfig("modelopt", "nvfp4", "nvfp4:modelopt", ignore)


def read_modelopt_fp8(qc: dict[str, Any]) -> QuantConfig:
    """modelopt FP8: e4m3 weights times a per-tensor `weight_scale`."""
    ignore = ignore_globs(modelopt_fields(qc).get("exclude_modules") or qc.get("ignore"))
    return QuantConfig("modelopt", "fp8:channel", "fp8:tensor:weight_scale", ignore)


def read_int(qc: dict[str, Any]) -> QuantConfig:
    """Integer weight-only checkpoints (compressed-tensors pack-quantized, AWQ GEMM, GPTQ): experts in
    the canonical int format (quant/intq.py); the scheme per Linear is read again at load
    (weights/int_source.py, quant/intq_schemes.py)."""
    method = str(qc.get("quant_method"))
    layout = {"compressed-tensors": "ct"}.get(method, method)
    if method == "compressed-tensors":
        ignore = ignore_exact_or_re(qc.get("ignore"))
    else:
        ignore = ignore_transformers(qc.get("modules_to_not_convert"))
    return QuantConfig(method, int_expert_format(qc), f"int:{layout}", ignore)


def ct_weights(qc: dict[str, Any]) -> dict[str, Any]:
    """The `weights` args of a compressed-tensors config: one set shared by every config group."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    args = [g.get("weights") for g in groups if g.get("weights")]
    if not args:
        raise ConfigError("compressed-tensors quantization_config has no config_groups with weights")
    if any(a != args[0] for a in args[1:]):
        raise ConfigError("compressed-tensors config_groups quantise weights differently: one scheme per model "
                          "is supported")
    return args[0]


def _pair(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ConfigError(f"{field} must be two positive ints [rows, cols], got {value!r}")
    return int(value[0]), int(value[1])


# (quant_method, scheme) -> reader. Architectures' own methods (gpt-oss's mxfp4) come first.
READERS: dict[tuple[str, str], Reader] = {
    ("fp8", ""): read_fp8,
    ("compressed-tensors", "float-quantized"): read_ct_float,
    ("compressed-tensors", "nvfp4-pack-quantized"): read_ct_nvfp4,
    ("modelopt", "NVFP4"): read_modelopt_nvfp4,
    ("modelopt", "FP8"): read_modelopt_fp8,
    ("compressed-tensors", "pack-quantized"): read_int,
    ("awq", ""): read_int,
    ("gptq", ""): read_int,
}


def quant_from_hf(hf: dict[str, Any], native: tuple[str, ...] = ()) -> QuantConfig | None:
    """The QuantConfig of a config.json: None when unquantised; `native`: methods the architecture
    reads itself (its checkpoint schema lists their tensors)."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "?"))
    if method in native:
        return QuantConfig(method)
    key = scheme_of(qc)
    reader = READERS.get(key)
    if reader is None:
        known = sorted({*native, *(m if not s else f"{m}/{s}" for m, s in READERS)})
        what = f"{key[0]!r}" + (f" with scheme {key[1]!r}" if key[1] else "")
        raise ConfigError(f"unsupported quantization_config.quant_method {what} for {hf.get('model_type')} "
                          f"(supported: {', '.join(known)})")
    return reader(qc)


# `--quantization NAME` for dummy weights: the quantization_config a release in that format ships
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    **INT_DUMMY_CONFIGS,  # int4 (W4A16, groups of 128, symmetric), int8 (W8A16, per channel)
}
QUANTIZATIONS = ("none", *DUMMY_CONFIGS)  # the choices of EngineConfig.quantization


def with_quantization(hf: dict[str, Any], quantization: str | None, dummy: bool) -> dict[str, Any]:
    """hf with `--quantization` applied: dummy weights take the named one (over a preset's own, as
    gpt-oss's mxfp4); a checkpoint's own config wins when it is the same format, and a different one
    is a ConfigError (weights are not quantised at load)."""
    if quantization in (None, "none"):
        return hf
    if quantization not in DUMMY_CONFIGS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    wanted = quant_from_hf({"quantization_config": DUMMY_CONFIGS[quantization], "model_type": hf.get("model_type")})
    own = quant_from_hf(hf, ("mxfp4",)) if hf.get("quantization_config") else None
    same = own is not None and wanted is not None and \
        (own.linear or own.method).split(":")[0] == wanted.linear.split(":")[0]
    if own is not None and (same or not dummy):  # dummy weights take the named format over a preset's own
        if same:
            return hf
        raise ConfigError(f"--quantization {quantization} conflicts with the model's own quantization_config "
                          f"({own.method}, experts in {own.format or own.method}); leave it out or pick that one")
    if not dummy:
        raise ConfigError(f"--quantization {quantization} needs --load-format dummy: a checkpoint holds its weights "
                          f"in its own format (this one is unquantised)")
    return {**hf, "quantization_config": dict(DUMMY_CONFIGS[quantization])}
