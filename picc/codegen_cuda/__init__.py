"""picc's GPU backend: TensorIR kernels, per-architecture CUDA schedules, CUDA and host builds.

The only package of picc that imports TVM. See docs/codegen_cuda.md.
"""

from picc.codegen_cuda.build import (
    CudaArtifact,
    HostKernel,
    build_cuda,
    build_host,
    compile_cuda_module,
    cuda_bundle,
    cuda_source,
    export_host_library,
    host_target,
    launch_configs,
    nvcc_compile,
    nvcc_path,
    thread_extents,
    write_cuda_sources,
)
from picc.codegen_cuda.dense import compact, gemm, gemv, predictor
from picc.codegen_cuda.ffn import FORMS, ROW_TILE, bias_add, dense_ffn, gate_first_ffn, padded, sparse_ffn
from picc.codegen_cuda.formats import FORMATS, WeightFormat, pack, split_blocks, split_q4_0, unpack
from picc.codegen_cuda.kernel import Kernel, Param
from picc.codegen_cuda.layers import (
    add,
    attention,
    attention_decode,
    attention_decode_fits,
    kv_append,
    layer_norm,
    merge,
    rms_norm,
    rope,
)
from picc.codegen_cuda.schedules import ARCHS, cpu_schedule, schedule

__all__ = [
    "ARCHS", "FORMATS", "FORMS", "ROW_TILE",
    "CudaArtifact", "HostKernel", "Kernel", "Param", "WeightFormat",
    "add", "attention", "attention_decode", "attention_decode_fits", "bias_add", "build_cuda", "build_host",
    "compact", "dense_ffn", "launch_configs", "merge", "thread_extents", "compile_cuda_module", "cpu_schedule",
    "cuda_bundle",
    "cuda_source", "export_host_library", "gate_first_ffn", "gemm", "gemv", "host_target", "kv_append",
    "layer_norm", "nvcc_compile", "nvcc_path", "pack", "padded", "predictor", "rms_norm", "rope",
    "schedule", "sparse_ffn", "split_blocks", "split_q4_0", "unpack", "write_cuda_sources",
]
