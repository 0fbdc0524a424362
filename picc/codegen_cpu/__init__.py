"""picc's CPU backend: kernels generated as LLVM IR and compiled with llvmlite.

The only package of picc that imports llvmlite (and it never imports TVM). Pieces:

* :mod:`.kernel` -- the kernel ABI (``void k(params..., i32 tid, i32 nthreads, ptr sync)``);
* :mod:`.kernels_dense`, :mod:`.kernels_ffn`, :mod:`.kernels_predictor`, :mod:`.kernels_prefill`,
  :mod:`.kernels_misc`, :mod:`.kernels_attention` -- the kernels (GEMV / GEMM / embedding, the
  fused sparse FFN and the predictor, its prefill form for a chunk of tokens, norms, rotary
  embedding, residual add, argmax, attention over a KV cache), built from :mod:`.rowformats`
  (the weight formats' blocks), :mod:`.rowops` (dot products, AXPYs, GEMV tiles), :mod:`.int16x`
  (int16 x), :mod:`.rows8` and :mod:`.rowplanes` (two weight layouts) and :mod:`.ffn_emitter`
  (what the two fused FFN kernels share);
* :mod:`.program` -- many kernel calls as one step function with barriers in between, and the
  greedy decode loop that calls a step again and again;
* :mod:`.lower` -- a placed, fused module to programs (``lower_module``): the decode step
  (:mod:`.lower_decode`), the chunk programs for prompts (:mod:`.lower_chunk`, and :mod:`.chunks`,
  their liveness and memory), what the two share (:mod:`.lower_ops`) and the ``bufs`` table
  (:mod:`.buffers`);
* :mod:`.compiler` -- :class:`CpuModule`: JIT compilation for a SIMD level, object code in and out;
* :mod:`.threads` -- :class:`ThreadTeam`: Python threads that run a kernel or a step together.

See docs/codegen_cpu.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from picc.codegen_cpu.compiler import CpuModule, effective_simd, host_simd
from picc.codegen_cpu.kernel import Kernel, module_ir
from picc.codegen_cpu.prelude import SYNC_BYTES
from picc.codegen_cpu.program import Buf, GreedyLoop, Null, Param, Program, buffer_table
from picc.codegen_cpu.threads import ThreadTeam
from runtime.hostmem import aligned_zeros, huge_zeros


def build_ir(kernels: Sequence[Kernel], programs: Sequence[Program | GreedyLoop] = (), simd: str = "host") -> str:
    """The LLVM IR text of a module with ``kernels`` and ``programs`` (and the kernels they call)."""
    all_kernels = list(kernels) + [k for p in programs for k in p.kernels]
    return module_ir(all_kernels, [p.emit() for p in programs], effective_simd(simd))


def compile_kernels(kernels: Sequence[Kernel], programs: Sequence[Program | GreedyLoop] = (),
                    simd: str = "host") -> CpuModule:
    """Compile ``kernels`` and ``programs`` for ``simd`` ("host", "avx512" or "avx2")."""
    return CpuModule(build_ir(kernels, programs, simd), simd)


__all__ = [
    "SYNC_BYTES", "Buf", "CpuModule", "GreedyLoop", "Kernel", "Null", "Param", "Program", "ThreadTeam", "aligned_zeros",
    "buffer_table", "build_ir", "compile_kernels", "effective_simd", "host_simd", "huge_zeros",
]
