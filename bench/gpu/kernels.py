"""picc's fused FFN CUDA kernels against cuBLAS and torch, on a GPU machine (no TVM needed).

    python3 kernels.py [--shapes 4096x11008,576x1536] [--batches 7] [--calls 20]

``prepare.py`` put the PTX of picc's ``sparse_ffn`` and ``dense_ffn`` kernels (f16 and q4_0 rows,
ReGLU at the LLaMA-7B shape, SwiGLU at SmolLM2's) in ``kernels/``. For each shape, format and active
share (5-100%) this times, GPU-side (a sleep kernel holds the stream while the launches queue;
medians of ``--batches`` batches of ``--calls`` calls):

* picc's sparse FFN over a sorted random set of active neurons (its rows read: up, gate, down);
* cuBLAS's dense f16 FFN (two ``torch.mv``, the activation) on the same shape;
* torch's gather (``index_select`` of the active rows, then ``mv``);
* picc's dense FFN kernel.

Consecutive calls read different memory, as a decode step's FFN does (every other layer's weights
pass between two tokens): each kernel rotates over copies of its weights and over sets of active
neurons that together span ``L2_SPAN`` bytes, several times an H100's 50 MiB L2, so the rates are
the device memory's, not the cache's (calls repeating one active set read a 10%-active 7B layer,
27 MB, from L2).

It prints GB/s of active rows read, that rate as a share of the device's copy bandwidth (a 1 GiB
device-to-device copy, bytes read and written, in the same run) and the ratios; the f16 kernel's
and q4_0 kernels' results are checked against torch's on the decoded weights (the table's rel err is
the larger). JSON to ``$OUT/kernels.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHARES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.8, 1.0)
L2_SPAN = 256 * 2**20
"""Bytes one rotation of a benchmark's calls reads (see the module docstring)."""


def rotation(nbytes: int) -> int:
    """How many copies (of weights, or of active sets) rotate so that their reads span ``L2_SPAN``."""
    return max(1, min(64, -(-L2_SPAN // max(1, nbytes))))


class Rotating:
    """Calls ``calls`` in turn, one per call."""

    def __init__(self, calls: list) -> None:
        self.calls, self.at = calls, 0

    def __call__(self) -> None:
        self.calls[self.at % len(self.calls)]()
        self.at += 1


class Kernel:
    """One of picc's kernels from its PTX, its launches bound to torch tensors."""

    def __init__(self, cu: ctypes.CDLL, name: str, meta: dict) -> None:
        self.cu, self.meta = cu, meta
        self.module = ctypes.c_void_p()
        ptx = (HERE / "kernels" / f"{name}.ptx").read_bytes() + b"\0"
        _check(cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(ptx)), f"load {name}")
        self.launches = []
        for la in meta["launches"]:
            fn = ctypes.c_void_p()
            _check(cu.cuModuleGetFunction(ctypes.byref(fn), self.module, la["entry"].encode()), la["entry"])
            self.launches.append((fn, la["grid"], la["block"], la["params"]))
        self.bound: list[tuple] = []

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        self.bound = self.bound_to(tensors)

    def bound_to(self, tensors: dict[str, torch.Tensor]) -> list[tuple]:
        """The kernel's launches with their pointer arguments set to ``tensors``."""
        bound = []
        for fn, grid, block, names in self.launches:
            pointers = [ctypes.c_uint64(tensors[n].data_ptr()) for n in names]
            args = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(p) for p in pointers])
            bound.append((fn, grid, block, args, pointers))
        return bound

    def caller(self, tensors: dict[str, torch.Tensor]):  # noqa: ANN201
        """A call of the kernel on ``tensors`` (its own pointer arguments, so callers can rotate).
        The call holds the tensors: their memory must outlive it."""
        bound = self.bound_to(tensors)
        return lambda held=tensors: self.launch(bound)

    def __call__(self) -> None:
        self.launch(self.bound)

    def launch(self, bound: list[tuple]) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for fn, grid, block, args, _ in bound:
            _check(self.cu.cuLaunchKernel(fn, *grid, *block, 0, stream, args, None), "cuLaunchKernel")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUDA error {result}")


def gpu_us(fn, calls: int, batches: int) -> float:  # noqa: ANN001
    """Median over ``batches`` of the device time of one of ``calls`` back-to-back calls, in us."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        torch.cuda._sleep(2_000_000)  # the launches queue behind it: host overhead is hidden
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(times)


def buffers(meta: dict, fmt_rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Device tensors for every parameter of a kernel: the shared ones from ``fmt_rows``, scratch
    and outputs fresh."""
    # uint32 (the q4 nibble words) as int32: the kernels see the same bits through a pointer.
    dtypes = {"float32": torch.float32, "float16": torch.float16, "int32": torch.int32, "uint32": torch.int32,
              "uint8": torch.uint8}
    out = {}
    for name, shape, dtype, _ in meta["params"]:
        out[name] = fmt_rows[name] if name in fmt_rows else torch.zeros(shape, dtype=dtypes[dtype], device="cuda")
    return out


def weights(meta: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights in the kernel's format (f16 rows, or q4_0 nibbles and f16 scales)."""
    h, n = meta["hidden"], meta["n_ff"]
    out = {}
    for name, shape, dtype, role in meta["params"]:
        if role != "in" or name in ("x", "idx", "count"):
            continue
        if dtype == "float16":
            scale = h ** -0.5 if name.startswith("W_ug") else n ** -0.5
            out[name] = (torch.randn(shape, generator=gen, device="cuda") * scale).half()
            if name.endswith("_d"):
                out[name] = (torch.rand(shape, generator=gen, device="cuda") * 0.01).half()
        elif dtype in ("uint8", "uint32"):  # nibble bytes, random; uint32 words of them as int32
            size = 4 if dtype == "uint32" else 1
            raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, device="cuda",
                                dtype=torch.uint8)
            out[name] = raw.view(torch.int32) if size == 4 else raw
    return out


def decoded(bufs: dict[str, torch.Tensor], prefix: str, fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Weight ``prefix`` as float32 from its buffers (f16, or q4_0's nibble words and scales:
    element j of a block is the low nibble of byte j for j < 16, the high nibble of byte j - 16)."""
    if fmt == "f16":
        return bufs[prefix].float().reshape(shape)
    qs, d = bufs[prefix + "_qs"].view(torch.uint8), bufs[prefix + "_d"].float()
    lo = ((qs & 15).float() - 8).reshape(*qs.shape[:-1], -1, 16)
    hi = ((qs >> 4).float() - 8).reshape(*qs.shape[:-1], -1, 16)
    return (d[..., None] * torch.cat([lo, hi], -1)).reshape(shape)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (gpu_us(lambda: dst.copy_(src), 3, 5) * 1e-6)


def of_shape(meta: dict, h: int, n: int, kind: str) -> dict[str, tuple[str, dict]]:
    """The kernels of ``kind`` for hidden ``h`` and ``n`` neurons, by weight format."""
    return {m["fmt"]: (k, m) for k, m in meta.items() if (m["hidden"], m["n_ff"], m["kind"]) == (h, n, kind)}


def bench_shape(cu: ctypes.CDLL, meta: dict, h: int, n: int, copy_bw: float, calls: int, batches: int) -> list[dict]:
    """The table of one FFN shape (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(h + n)
    sparse, dense = of_shape(meta, h, n, "sparse_ffn"), of_shape(meta, h, n, "dense_ffn")
    form = next(iter(sparse.values()))[1]["form"]
    act = torch.relu if form == "reglu" else torch.nn.functional.silu
    x = torch.randn(h, generator=gen, device="cuda")
    kernels: dict[str, tuple[Kernel, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = {}
    t_picc_dense = {}
    for fmt, (name, m) in sparse.items():
        first = weights(m, gen)
        copies = [first] + [weights(m, gen) for _ in range(rotation(sum(t.nbytes for t in first.values())) - 1)]
        bufs = buffers(m, {"x": x, **first})  # scratch, output and index list shared by the copies
        kernels[fmt] = (Kernel(cu, name, m), bufs, copies)
        dk, dm = Kernel(cu, dense[fmt][0], dense[fmt][1]), dense[fmt][1]
        scratch = buffers(dm, {"x": x, **first})
        t_picc_dense[fmt] = gpu_us(Rotating([dk.caller({**scratch, **w}) for w in copies]), calls, batches)
    f16 = kernels["f16"][2]
    x16 = x.half()

    def cublas_dense(w: dict[str, torch.Tensor]) -> torch.Tensor:
        ug = torch.mv(w["W_ug"].view(2 * n, h), x16).view(n, 2)
        return torch.mv(w["down"].t(), act(ug[:, 1]) * ug[:, 0])

    def gather(w: dict[str, torch.Tensor], li: torch.Tensor) -> torch.Tensor:
        g = (w["W_ug"].index_select(0, li).view(-1, h) @ x16).view(-1, 2)
        return (act(g[:, 1]) * g[:, 0]) @ w["down"].index_select(0, li)

    t_dense = gpu_us(Rotating([lambda w=w: cublas_dense(w) for w in f16]), calls, batches)
    print(f"\n{h}x{n} {form}: cuBLAS dense f16 {t_dense:.1f} us ({3 * n * h * 2 / t_dense / 1e3:.0f} GB/s); "
          f"picc dense_ffn f16 {t_picc_dense['f16']:.1f} us, q4_0 {t_picc_dense['q4_0']:.1f} us")
    print("| active | picc f16 us | GB/s | share of copy bw | rel err | vs cuBLAS dense | torch gather us "
          "| vs torch gather | picc q4_0 us | q4_0 vs f16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for share in SHARES:
        a = max(1, int(n * share))
        sets = [torch.sort(torch.randperm(n, generator=gen, device="cuda")[:a]).values.int()
                for _ in range(rotation(a * h * 2 * 3))]
        row = {"shape": f"{h}x{n}", "form": form, "active": share, "cublas_dense_us": t_dense,
               "picc_dense_us": t_picc_dense, "rotation": len(sets)}
        for fmt, (k, bufs, copies) in kernels.items():
            callers = []
            for i, idx in enumerate(sets):
                lists = {"idx": torch.zeros_like(bufs["idx"]), "count": torch.full_like(bufs["count"], a)}
                lists["idx"][:a] = idx
                callers.append(k.caller({**bufs, **copies[i % len(copies)], **lists}))
            row[f"picc_{fmt}_us"] = gpu_us(Rotating(callers), calls, batches)
            bufs["y"].fill_(float("nan"))  # each format against torch on its decoded weights
            callers[0]()
            torch.cuda.synchronize()
            w0, li = copies[0], sets[0].long()
            ug = torch.einsum("rjh,h->rj", decoded(w0, "W_ug", fmt, (n, 2, h))[li], x)
            ref = (act(ug[:, 1]) * ug[:, 0]) @ decoded(w0, "down", fmt, (n, h))[li]
            row[f"rel_err_{fmt}"] = float((bufs["y"] - ref).abs().max() / ref.abs().max())
        row["rel_err"] = max(row[f"rel_err_{fmt}"] for fmt in kernels)
        pairs = [(f16[i % len(f16)], idx.long()) for i, idx in enumerate(sets)]
        row["torch_gather_us"] = gpu_us(Rotating([lambda p=p: gather(*p) for p in pairs]), calls, batches)
        t16 = row["picc_f16_us"]
        row["GBps"] = a * h * 2 * 3 / (t16 * 1e-6) / 1e9
        row["copy_share"] = row["GBps"] * 1e9 / copy_bw
        rows.append(row)
        print(f"| {share:.0%} | {t16:.1f} | {row['GBps']:.0f} | {row['copy_share']:.0%} | {row['rel_err']:.1e} "
              f"| {t_dense / t16:.2f}x | {row['torch_gather_us']:.1f} | {row['torch_gather_us'] / t16:.2f}x "
              f"| {row['picc_q4_0_us']:.1f} | {t16 / row['picc_q4_0_us']:.2f}x |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x11008,576x1536")
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    meta = json.loads((HERE / "kernels" / "kernels.json").read_text())
    torch.zeros(1, device="cuda")  # the primary context, which the driver calls below share
    cu = ctypes.CDLL("libcuda.so.1")
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    results: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "rows": []}
    for shape in args.shapes.split(","):
        h, n = (int(v) for v in shape.split("x"))
        results["rows"] += bench_shape(cu, meta, h, n, copy_bw, args.calls, args.batches)
    Path(os.environ.get("OUT", "."), "kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
