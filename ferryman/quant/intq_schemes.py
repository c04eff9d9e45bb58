"""`quantization_config` of integer weight-only checkpoints -> `IntScheme`: which linears are packed,
with which bits / groups / zero points, in which checkpoint layout (quant/intq_layouts.py).

    compressed-tensors  format "pack-quantized"; config_groups {targets, weights {num_bits, type "int",
                        symmetric, strategy "group"|"channel", group_size, actorder}}; ignore (names or
                        "re:" patterns, matched from the start as compressed-tensors does)
    awq                 bits 4, group_size, zero_point true, version "gemm" (every linear stored packed is one)
    gptq                bits 4|8, group_size (-1: channel), sym, desc_act, checkpoint_format
                        "gptq" (zeros stored minus one) | "gptq_v2"
Every unknown or unsupported field value is a ValueError naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferryman.errors import ConfigError
from ferryman.quant.intq import IntParams
from ferryman.quant.intq_layouts import PackedInt, from_awq, from_compressed_tensors, from_gptq

CT_INT_FORMATS = ("pack-quantized",)
# expert linears as the per-expert checkpoints name them: a config group applies to the routed experts
# when its targets match these (compressed-tensors' "Linear" matches every linear)
EXPERT_SAMPLES = ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.block_sparse_moe.experts.0.w1")


@dataclass(frozen=True)
class IntScheme:
    layout: str  # "compressed-tensors" | "awq" | "gptq"
    groups: tuple[tuple[tuple[str, ...], IntParams], ...]  # (targets, params) per config group
    ignore: tuple[str, ...] = ()
    zeros_minus_one: bool = False  # GPTQ v1

    @property
    def marker(self) -> str:
        """The tensor suffix that marks a packed linear."""
        return "weight_packed" if self.layout == "compressed-tensors" else "qweight"

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Every tensor a packed linear `X.` holds, as `X.<suffix>`."""
        if self.layout == "compressed-tensors":
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
        return ("qweight", "qzeros", "scales", "g_idx")

    def params_of(self, module: str) -> IntParams | None:
        """The scheme of linear `module` (a name without `.weight`), None when it is not packed."""
        if any(_matches(module, pat, self.layout) for pat in self.ignore):
            return None
        for targets, params in self.groups:
            if any(_matches(module, t, self.layout) for t in targets):
                return params
        return None

    def expert_params(self) -> IntParams:
        """The scheme of the routed experts (one per model: the expert banks hold one format)."""
        found = {p for s in EXPERT_SAMPLES if (p := self.params_of(s)) is not None}
        if not found:
            found = {p for _, p in self.groups}
        if len(found) != 1:
            raise ValueError(f"quantization_config: the routed experts match {len(found)} schemes "
                             f"({', '.join(sorted(p.name for p in found))}); one layer holds one format")
        return found.pop()

    def repack(self, params: IntParams, prefix: str, get: Callable[[str], torch.Tensor], names: set[str]) -> PackedInt:
        """Linear `prefix` (ending in '.') in the canonical layout."""
        if self.layout == "compressed-tensors":
            return from_compressed_tensors(params, prefix, get, names)
        if self.layout == "awq":
            return from_awq(params, prefix, get)
        return from_gptq(params, prefix, get, names, self.zeros_minus_one)


def _matches(module: str, pattern: str, layout: str) -> bool:
    if layout != "compressed-tensors":  # AWQ/GPTQ: one scheme for every packed linear
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in ("Linear", module)


def int_scheme(qc: dict[str, Any]) -> IntScheme:
    """The IntScheme of a `quantization_config`; ValueError naming the field it cannot take."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    raise ValueError(f"quantization_config.quant_method {method!r} is no integer weight scheme")


def int_expert_format(qc: dict[str, Any]) -> str:
    """The expert format name of an integer checkpoint's routed experts; ConfigError naming the field."""
    try:
        return int_scheme(qc).expert_params().name
    except ValueError as e:
        raise ConfigError(str(e)) from None


# `--quantization` for dummy weights: the quantization_config a preset gets (compressed-tensors W4A16 /
# W8A16, the layout of the community int releases)
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    name: {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    for name, weights in (
        ("int4", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}),
        ("int8", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}),
        # groups of 32, as MXFP4's blocks: models whose dims are no multiple of 128 (gpt-oss: 2880)
        ("int4-g32", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}),
    )
}


def _bits(value: Any, allowed: tuple[int, ...], field: str) -> int:
    if value not in allowed:
        raise ValueError(f"quantization_config.{field} {value!r} is not supported (supported: "
                         f"{', '.join(map(str, allowed))})")
    return int(value)


def _group(value: Any, field: str) -> int:
    """group_size -> IntParams.group (0: one group per row)."""
    if value in (-1, None, 0):
        return 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"quantization_config.{field} must be a positive integer or -1, got {value!r}")
    return value


def _ct_params(name: str, w: dict[str, Any], fmt: str) -> IntParams:
    field = f"config_groups.{name}.weights"
    if fmt not in CT_INT_FORMATS:
        raise ValueError(f"quantization_config.{name}: format {fmt!r} mixes with integer weights in one "
                         f"checkpoint; this loader takes {', '.join(CT_INT_FORMATS)} alone")
    if w.get("type", "int") != "int":
        raise ValueError(f"quantization_config.{field}.type {w.get('type')!r}: pack-quantized weights are 'int'")
    bits = _bits(w.get("num_bits"), (4, 8), f"{field}.num_bits")
    strategy = w.get("strategy")
    if strategy == "group":
        group = _group(w.get("group_size"), f"{field}.group_size")
        if not group:
            raise ValueError(f"quantization_config.{field}.group_size must be set for strategy 'group'")
    elif strategy == "channel":
        group = 0
    else:
        raise ValueError(f"quantization_config.{field}.strategy {strategy!r} is not supported "
                         f"(supported: group, channel)")
    if w.get("dynamic"):
        raise ValueError(f"quantization_config.{field}.dynamic: weights need static scales")
    act = w.get("actorder") == "group" and group > 0
    return IntParams(bits, group, bool(w.get("symmetric", True)), act)


def _compressed_tensors(qc: dict[str, Any]) -> IntScheme:
    groups = []
    for name, g in (qc.get("config_groups") or {}).items():
        if g.get("input_activations"):
            raise ValueError(f"quantization_config.config_groups.{name}.input_activations: quantised "
                             f"activations are not supported (weight-only W4A16/W8A16 are)")
        if not g.get("weights"):
            continue
        params = _ct_params(name, g["weights"], g.get("format") or qc.get("format"))
        groups.append((tuple(g.get("targets") or ("Linear",)), params))
    if not groups:
        raise ValueError("quantization_config.config_groups: no group quantises weights")
    return IntScheme("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()))


def _awq(qc: dict[str, Any]) -> IntScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: AWQ weights are read in the GEMM packing")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false: AWQ GEMM weights without zero points are not supported")
    bits = _bits(qc.get("bits", qc.get("w_bit")), (4,), "bits")
    group = _group(qc.get("group_size", qc.get("q_group_size")), "group_size")
    # AWQ and GPTQ pack every linear with one scheme: the tensors say which are packed, so
    # modules_to_not_convert (whose matching differs between their tools) is not consulted
    return IntScheme("awq", ((("",), IntParams(bits, group, False)),))


def _gptq(qc: dict[str, Any]) -> IntScheme:
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    bits = _bits(qc.get("bits"), (4, 8), "bits")
    group = _group(qc.get("group_size"), "group_size")
    params = IntParams(bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act")) and group > 0)
    return IntScheme("gptq", ((("",), params),), zeros_minus_one=fmt == "gptq")
