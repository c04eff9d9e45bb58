"""Integer weight-only checkpoints (compressed-tensors pack-quantized, AWQ, GPTQ) seen through the
logical names the architectures list: each packed linear `X` (its `X.weight_packed`/`X.qweight` and
companions) appears as `X.weight` of its unquantised shape. Routed experts come back as `PackedInt`
(the store keeps them packed, quant/intq.py); every other linear is dequantised to fp32 at load.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.errors import ConfigError, ModelLoadError, WeightError
from ferryman.models.base import Architecture
from ferryman.quant.intq import IntParams, parse_name
from ferryman.quant.intq_layouts import PackedInt, random_packed
from ferryman.quant.intq_schemes import IntScheme, int_scheme
from ferryman.weights.sources import Shape, TensorSource

def int_source(source: TensorSource, hf: dict[str, Any], cfg: ModelConfig, arch: Architecture, dummy: bool,
               seed: int, device: torch.device) -> TensorSource:
    """`source` seen through the integer scheme of hf's quantization_config, when it has one."""
    if cfg.quant is None or not cfg.quant.linear.startswith("int:"):  # quant/hf_quant.py read_int
        return source

    def is_expert(name: str) -> bool:  # a routed expert's weight (not its bias)
        target = arch.map_name(cfg, name)
        return target is not None and target.kind == "expert" and target.name in ("w13", "w2")

    def transposed(name: str) -> bool:  # stored [in, out]
        target = arch.map_name(cfg, name)
        return target is not None and target.transpose

    if dummy:
        return IntDummySource(source, parse_name(cfg.expert_format), is_expert, transposed, seed, device)
    try:
        scheme = int_scheme(hf["quantization_config"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return IntQuantSource(source, scheme, is_expert)


IsExpert = Callable[[str], bool]  # whether a logical tensor name is a routed expert's weight


class IntQuantSource:
    def __init__(self, inner: TensorSource, scheme: IntScheme, is_expert: IsExpert) -> None:
        self.inner, self.scheme, self.is_expert = inner, scheme, is_expert
        names = inner.names()
        marker = "." + scheme.marker
        # prefix "X." of each packed linear -> its scheme
        self.packed: dict[str, IntParams] = {}
        for n in names:
            if n.endswith(marker):
                prefix = n[: -len(scheme.marker)]
                params = scheme.params_of(prefix[:-1])
                if params is None:
                    raise WeightError(n, inner.file_of(n), reason="packed, but quantization_config leaves this "
                                                                  "linear unquantised (ignore / targets)")
                self.packed[prefix] = params
        hidden = {p + s for p in self.packed for s in scheme.suffixes}
        self._names = (names - hidden) | {p + "weight" for p in self.packed}

    def names(self) -> set[str]:
        return self._names

    def _prefix(self, name: str) -> str | None:
        prefix = name.removesuffix("weight")
        return prefix if name.endswith(".weight") and prefix in self.packed else None

    def shape(self, name: str) -> Shape:
        prefix = self._prefix(name)
        if prefix is None:
            return self.inner.shape(name)
        if self.scheme.layout == "compressed-tensors":
            return tuple(int(v) for v in self.inner.get(prefix + "weight_shape").tolist())
        k_words, out = self.inner.shape(prefix + "qweight")
        if self.scheme.layout == "awq":  # [K, out/8]
            return out * 8, k_words
        return out, k_words * self.packed[prefix].per_word  # gptq: [K/P, out]

    def file_of(self, name: str) -> str:
        prefix = self._prefix(name)
        return self.inner.file_of(name if prefix is None else prefix + self.scheme.marker)

    def get(self, name: str) -> torch.Tensor | PackedInt:
        prefix = self._prefix(name)
        if prefix is None:
            return self.inner.get(name)
        try:
            packed = self.scheme.repack(self.packed[prefix], prefix, self.inner.get, self.inner.names())
        except ValueError as e:
            raise ModelLoadError(f"{self.file_of(name)}: {e}") from None
        return packed if self.is_expert(name) else packed.dequant(torch.float32)


class IntDummySource:
    """Dummy weights whose routed experts are random packed linears of `params` (generated packed:
    nothing is quantised), everything else from the plain dummy source."""

    def __init__(self, inner: TensorSource, params: IntParams, is_expert: IsExpert, transposed: IsExpert, seed: int,
                 device: torch.device) -> None:
        self.inner, self.params, self.is_expert, self.seed, self.device = inner, params, is_expert, seed, device
        self.transposed = transposed

    def names(self) -> set[str]:
        return self.inner.names()

    def shape(self, name: str) -> Shape:
        return self.inner.shape(name)

    def file_of(self, name: str) -> str:
        return self.inner.file_of(name)

    def get(self, name: str) -> torch.Tensor | PackedInt:
        if not self.is_expert(name):
            return self.inner.get(name)
        *lead, out, k = self.inner.shape(name)  # [out, K], or all experts [E, out, K] (gpt-oss: [E, K, out])
        if self.transposed(name):
            out, k = k, out
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return random_packed(self.params, out, k, g, self.device, tuple(lead))

