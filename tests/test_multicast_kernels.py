"""The multimem kernels compiled for sm_90 without running them: the PTX carries the
multicast instructions with the intended types (bf16x2 inputs, fp32 accumulation, 16-byte
vectors), and ptxas accepts them.  No GPU needed; nothing is launched."""
from __future__ import annotations

import shutil

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tide_triton.kernels import multimem as mm

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, signature, constexprs):
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
    except RuntimeError as e:  # a triton without the CUDA backend's tools cannot get to PTX
        if "ptxas" in str(e) and shutil.which("ptxas") is None:
            pytest.skip(f"no ptxas for sm_90 in this triton install: {e}")
        raise


@pytest.mark.parametrize("has_scale,accumulate", [(False, False), (True, True)])
def test_reduce_kernel_ptx(has_scale, accumulate):
    k = _compile(mm.multimem_reduce_kernel,
                 {"mc_addr": "i64", "out_ptr": "*fp32", "numel": "i64", "scale": "fp32",
                  "HAS_SCALE": "constexpr", "ACCUMULATE": "constexpr", "BLOCK": "constexpr"},
                 {"HAS_SCALE": has_scale, "ACCUMULATE": accumulate, "BLOCK": 512})
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith(("multimem.", "@%p multimem."))]
    assert lines and all(mm.LD_REDUCE_PTX in ln for ln in lines), lines
    # four 32-bit registers (8 bf16) per 64-bit address, predicated on the tail mask
    assert all(ln.startswith("@%p") and "{%r" in ln and "[%rd" in ln for ln in lines)
    assert "multimem.st" not in "\n".join(lines)
    assert "st.global" in ptx  # the fp32 results go to ordinary memory
    assert len(k.asm["cubin"]) > 0  # ptxas accepted the instruction for sm_90


@pytest.mark.parametrize("src", ["*fp32", "*fp16", "*bf16"])
def test_store_kernel_ptx(src):
    k = _compile(mm.multimem_store_kernel, {"src_ptr": src, "mc_addr": "i64", "numel": "i64", "BLOCK": "constexpr"},
                 {"BLOCK": 512})
    ptx = k.asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith(("multimem.", "@%p multimem."))]
    assert lines and all(mm.ST_PTX in ln for ln in lines), lines
    assert "ld_reduce" not in "\n".join(lines)
    if src != "*bf16":  # the cast to bf16 is fused (one rounding, to nearest even; fp16 -> fp32 is exact)
        assert "cvt.rn.bf16" in ptx
    assert len(k.asm["cubin"]) > 0


def test_launchers_validate():
    import torch

    with pytest.raises(TypeError, match="out must be a contiguous float32 CUDA tensor"):
        mm.multimem_reduce(0, 0, torch.empty(8))
    with pytest.raises(TypeError, match="src must be a contiguous float32, float16 or bfloat16 CUDA tensor"):
        mm.multimem_store(torch.empty(8), 0, 0)
    with pytest.raises(ValueError, match="offset must be a multiple of 8"):
        mm.multimem_store_ref(torch.empty(8), [torch.zeros(16, dtype=torch.bfloat16)], 4)
