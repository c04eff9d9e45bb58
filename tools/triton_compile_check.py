"""Compile Triton kernels for an sm_90 target without a GPU, to catch compile errors (globals,
dtype mismatches) that the interpreter (TRITON_INTERPRET=1) does not see.

    python tools/triton_compile_check.py ferryman.quant.mxfp4_triton:_dequant_kernel 'blocks_ptr=*u8,...' GROUPS=64
"""

from __future__ import annotations

import importlib
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_check(qualname: str, signature: dict[str, str], constexprs: dict[str, int], stage: str = "ttgir",
                  divisible: tuple[str, ...] = ()) -> str:
    """The kernel's `stage` text (ttgir, llir, ptx). `divisible`: arguments that a launch would find
    divisible by 16 (pointers 16-byte aligned), the specialisation that lets loads vectorise."""
    mod, name = qualname.split(":")
    fn = getattr(importlib.import_module(mod), name)
    sig = dict(signature)
    for k, v in constexprs.items():
        sig[k] = "constexpr"
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    return out.asm[stage] if stage in out.asm else ""


if __name__ == "__main__":
    qual, sig_s, *cx = sys.argv[1:]
    sig = dict(kv.split("=") for kv in sig_s.split(","))
    cons = {k: int(v) for k, v in (c.split("=") for c in cx)}
    text = compile_check(qual, sig, cons)
    print(f"compiled {qual}: {len(text)} chars of ttgir")
