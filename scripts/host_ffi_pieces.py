"""What the TVM-FFI call of a tiny forward spends its host time on (H200 helper, not a test).

`scripts/host_overhead.py` times the tiny (1, 128, 8, 64) causal call's pieces; its largest
is the TVM-FFI call of the compiled kernel (5.8-8.8 us on the lent hosts), whose host code
encodes four TMA descriptors (Q, K, V loads, the O store) with `cuTensorMapEncodeTiled` and
launches with `cuLaunchKernelEx`. This times, on the same tensors:
- one `cuTensorMapEncodeTiled` of q's (D, H, S, B) box through ctypes, against a ctypes call
  of `cuCtxGetCurrent` (the ctypes cost alone);
- a CuTe DSL kernel that does nothing, compiled with `--enable-tvm-ffi` over the forward's
  five tensor arguments and two scalars, launched through its TVM-FFI function (argument
  conversion, checks and a launch, no descriptors);
- the forward's own TVM-FFI call.

    python3 scripts/host_ffi_pieces.py
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import _host  # noqa: E402

CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, SWIZZLE_128B, L2_PROMOTION_128B = 9, 3, 2


def driver_pieces(q: torch.Tensor) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    buf = (ctypes.c_uint8 * 256)()
    tmap = ctypes.c_void_p((ctypes.addressof(buf) + 63) // 64 * 64)  # 64-byte aligned
    b, s, h, d = q.shape
    dims = (ctypes.c_uint64 * 4)(d, h, s, b)
    strides = (ctypes.c_uint64 * 3)(*(x * q.element_size() for x in q.stride()[2::-1]))
    box = (ctypes.c_uint32 * 4)(d, 1, 64, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    ptr = ctypes.c_void_p(q.data_ptr())
    encode = cuda.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    args = (tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, ptr, dims, strides, box, ones, 0,
            SWIZZLE_128B, L2_PROMOTION_128B, 0)  # fmt: skip
    rc = encode(*args)
    assert rc == 0, f"cuTensorMapEncodeTiled returned {rc}"
    ctx = ctypes.c_void_p()
    current = cuda.cuCtxGetCurrent
    return {
        "ctypes cuCtxGetCurrent": _host(lambda: current(ctypes.byref(ctx)), reps=20000),
        "ctypes cuTensorMapEncodeTiled (one descriptor)": _host(lambda: encode(*args), reps=20000),
    }


@cute.kernel
def _nothing(a: cute.Tensor):
    pass


@cute.jit
def _launch_nothing(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor,
                    lse: cute.Tensor, scale: cutlass.Float32, n: cutlass.Int32,
                    stream):  # fmt: skip
    _nothing(q).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)


def empty_kernel_call(q, k, v, out, lse) -> dict:
    # the forward's fake argument types (cute_attn.arch.sm90.compile), so that the TVM-FFI
    # wrapper checks the same shapes, strides and alignments
    from cute_attn.arch.sm90.compile import _fake_bshd, _fake_rows

    b, s = cute.sym_int(), cute.sym_int()
    h, d = q.shape[2], q.shape[3]
    fq, fo = _fake_bshd(cutlass.BFloat16, h, d, b, s), _fake_bshd(cutlass.BFloat16, h, d, b, s)
    fk = _fake_bshd(cutlass.BFloat16, k.shape[2], d, cute.sym_int(), cute.sym_int())
    fv = _fake_bshd(cutlass.BFloat16, v.shape[2], d, cute.sym_int(), cute.sym_int())
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = cute.compile(_launch_nothing, fq, fk, fv, fo, _fake_rows(b, h, s), cutlass.Float32(1.0),
                      cutlass.Int32(1), stream, options="--enable-tvm-ffi")  # fmt: skip
    fn(q, k, v, out, lse, 1.0, 1)
    torch.cuda.synchronize()
    return {"empty DSL kernel (TVM-FFI call)": _host(lambda: fn(q, k, v, out, lse, 1.0, 1), 500)}


def main():
    import cute_attn
    from cute_attn import fwd_sm90
    from cute_attn.validation import validate_dense

    q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(1, 8, 128, device="cuda")
    cute_attn.flash_attn_func(q, k, v, causal=True)
    p = validate_dense(q, k, v, softmax_scale=None, causal=True, window_size=(None, None),
                       softcap=0.0, num_splits=0, pack_gqa=None, deterministic=False)  # fmt: skip
    plan = fwd_sm90._plan(p, fwd_sm90._DENSE, 1, 128, 128, False, q.device.index)
    tail = (*plan.scalars, *[None] * 7)
    for _ in range(2):  # twice: the second pass is the steady one
        pieces = {**driver_pieces(q), **empty_kernel_call(q, k, v, out, lse)}
        pieces["the forward's TVM-FFI call"] = _host(lambda: plan.fn(q, k, v, out, lse, *tail))
        for name, us in pieces.items():
            print(f"  {name:<48} {us:6.2f} us")


if __name__ == "__main__":
    main()
