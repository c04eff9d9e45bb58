"""Expert weight formats (banks + reference dequantisation); importing registers them."""

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, get_format, known_formats,
                                 register_family, register_format)
from ferryman.quant.dense import DenseFormat
from ferryman.quant.gguf import GgufFormat, gguf_format
from ferryman.quant.intq import IntFormat
from ferryman.quant.mxfp4 import Mxfp4Format, dequant_mxfp4, quantize_mxfp4, random_mxfp4

__all__ = ["Banks", "BankSpec", "DenseFormat", "ExpertFormat", "GgufFormat", "IntFormat", "Mxfp4Format",
           "dequant_mxfp4", "get_format", "gguf_format", "known_formats", "quantize_mxfp4", "random_mxfp4",
           "register_family",
           "register_format"]
from ferryman.quant.fp8 import Fp8Format  # noqa: E402  (registers the fp8 family)
from ferryman.quant.nvfp4 import Nvfp4Format  # noqa: E402  (registers nvfp4, nvfp4-ct)

__all__ += ["Fp8Format", "Nvfp4Format"]
