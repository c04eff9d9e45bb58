"""Compile Triton kernels for an sm_90 target without a GPU, to catch compile errors (globals,
dtype mismatches) that the interpreter (TRITON_INTERPRET=1) does not see.

    python tools/triton_compile_check.py ferryman.quant.mxfp4_triton:_dequant_kernel 'blocks_ptr=*u8,...' GROUPS=64
"""

from __future__ import annotations

import argparse
import importlib

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="module:function of a @triton.jit kernel")
    ap.add_argument("signature", help="comma-separated name=type of its runtime arguments (*u8, *bf16, i32, fp32, ...)")
    ap.add_argument("constexprs", nargs="*", help="NAME=int for each constexpr argument")
    ap.add_argument("--stage", default="ttgir", choices=["ttir", "ttgir", "llir", "ptx"],
                    help="output to report (default: ttgir)")
    a = ap.parse_args()
    try:
        sig = dict(kv.split("=", 1) for kv in a.signature.split(","))
        cons = {k: int(v) for k, v in (c.split("=", 1) for c in a.constexprs)}
    except ValueError:
        ap.error("signature: name=type,...; constexprs: NAME=int")
    text = compile_check(a.kernel, sig, cons, a.stage)
    print(f"compiled {a.kernel}: {len(text)} chars of {a.stage}")


if __name__ == "__main__":
    main()
