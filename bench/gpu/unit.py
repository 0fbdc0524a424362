"""Each kernel of the GPU check alone, in allocations of exactly its buffers' sizes, against its host build.

    python3 unit.py [KERNEL ...]        # default: every kernel of units/units.json
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 unit.py KERNEL

``prepare.py`` recorded, for every distinct kernel (``<arch>.<name>``), its arguments before and
after one real call on the host-emulated GPU. Here each runs on the device from its own ``.pib``'s
code with every argument in its own allocation of exactly its size -- so that ``compute-sanitizer``
sees an access past a buffer, which inside a model's arena lands in a neighbour unseen -- and every
argument afterwards is compared with the host build's (relative to the buffer's largest value).
One kernel per process under memcheck: after an invalid access the context is unusable.
Exit status 1 when a kernel's results differ by more than 1e-4 (float sums in other orders differ
by ~1e-6) or a launch fails.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "src"))

from runtime.contracts import CudaManifest  # noqa: E402
from runtime.cuda import Driver  # noqa: E402
from runtime.gpu import arena_image  # noqa: E402
from runtime.pib import PibFile  # noqa: E402

BOUND = 1e-4


def run_unit(cu: Driver, key: str, unit: dict) -> list[tuple[str, float]]:
    """``unit``'s kernel on the device; per argument, its error against the host build's."""
    data = np.load(HERE / "units" / f"{key}.npz")
    pib = PibFile(HERE / "pibs" / f"{unit['pib']}.pib")
    manifest = CudaManifest.from_json(pib.json("cuda/manifest"))
    initial = arena_image(pib, pib.plan().gpu_bytes)

    def before(name: str, shape: list[int], dtype: str, offset: int) -> np.ndarray:
        """The argument as the call found it: recorded, or (a weight, a constant) as loaded."""
        if f"in.{name}" in data.files:
            return np.ascontiguousarray(data[f"in.{name}"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return initial[offset : offset + nbytes].view(dtype).reshape(shape).copy()

    arch = manifest.arch
    image = pib.section(f"cuda/{arch}/model.ptx") + b"\0"  # PTX: runs on this device or any newer one
    module = ctypes.c_void_p()
    cu("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
    pointers: dict[str, ctypes.c_uint64] = {}
    try:
        inputs = {p[0]: before(*p) for p in unit["params"]}
        for name, host in inputs.items():
            pointers[name] = ctypes.c_uint64()
            cu("cuMemAlloc_v2", ctypes.byref(pointers[name]), ctypes.c_size_t(host.nbytes))
            cu("cuMemcpyHtoD_v2", pointers[name], host.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(host.nbytes))
        for launch in manifest.kernels[unit["kernel"]]:
            fn = ctypes.c_void_p()
            cu("cuModuleGetFunction", ctypes.byref(fn), module, launch.entry.encode())
            values = [ctypes.c_uint64(pointers[p].value) for p in launch.params]
            args = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            cu("cuLaunchKernel", fn, *launch.grid, *launch.block, 0, None, args, None)
            cu("cuCtxSynchronize")
        errors = []
        for name, host in inputs.items():
            want = data[f"out.{name}"] if f"out.{name}" in data.files else host
            got = np.empty_like(want)
            cu("cuMemcpyDtoH_v2", got.ctypes.data_as(ctypes.c_void_p), pointers[name], ctypes.c_size_t(got.nbytes))
            a, b = got.astype(np.float64), want.astype(np.float64)
            scale = max(float(np.abs(b).max()), 1e-30) if b.size else 1.0
            errors.append((name, float(np.abs(a - b).max() / scale) if b.size else 0.0))
        return errors
    finally:
        for p in pointers.values():
            cu("cuMemFree_v2", p)
        cu("cuModuleUnload", module)


def main() -> None:
    units = json.loads((HERE / "units" / "units.json").read_text())
    keys = sys.argv[1:] or list(units)
    cu = Driver()
    cu("cuInit", 0)
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu("cuDeviceGet", ctypes.byref(device), 0)
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
    cu.use(ctx)
    failed = 0
    for key in keys:
        try:
            errors = run_unit(cu, key, units[key])
        except Exception as e:  # noqa: BLE001 - a failed launch is this kernel's result
            print(f"| {key} | ERROR {e} | |", flush=True)
            failed += 1
            continue
        worst = max(errors, key=lambda e: e[1])
        ok = worst[1] <= BOUND
        failed += not ok
        print(f"| {key} | {worst[1]:.1e} ({worst[0]}) | {'ok' if ok else 'DIFFERS'} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
