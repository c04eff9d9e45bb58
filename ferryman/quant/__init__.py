"""Expert weight formats (banks + reference dequantisation); importing registers them."""

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, get_format, known_formats,
                                 register_family, register_format)
from ferryman.quant.dense import DenseFormat
from ferryman.quant.gguf import GgufFormat, gguf_format
from ferryman.quant.mxfp4 import Mxfp4Format, dequant_mxfp4, quantize_mxfp4, random_mxfp4

__all__ = ["Banks", "BankSpec", "DenseFormat", "ExpertFormat", "GgufFormat", "Mxfp4Format", "dequant_mxfp4",
           "get_format", "gguf_format", "known_formats", "quantize_mxfp4", "random_mxfp4", "register_family",
           "register_format"]
