"""What a placement buys: per layer where the neurons and bytes are, and the cost model's tokens/s.

Everything here is read off a placed module (``partition-neurons``) and its memory plan, so
``picc compile`` and ``picc inspect`` report the same numbers. The estimate is for decoding one
token with the KV cache half full (``ctx / 2`` positions): every op reads its weights from its
device's memory at that device's bandwidth (decode is memory-bound), on the CPU at the rate its
kernel reads that format (the target's kernel rates, at most the bandwidth: 4-bit formats are
bound by the arithmetic on small CPUs, see ``picc.codegen_cpu.rates``); the two parts of a
split FFN run concurrently, so such a layer costs its slower part; a value that an op reads from
the other device crosses PCIe (the target's latency plus bytes over the link's bandwidth), and so
do the logits when the LM head runs on the GPU. Dense ops run one after another. On the GPU, every
kernel launch costs the target's ``kernel_overhead`` besides its bytes and every stage of the
schedule with GPU work its ``sync_overhead`` (a graph launch and the host's wait): on small models
these, not the bytes, are the GPU's time. The estimate leaves out attention's arithmetic, the
CPU's barriers and calls, and counts every byte as read from memory: it is an upper bound unless
the weights fit in the CPU's caches.
"""

from __future__ import annotations

from picc import kernel_names as names
from picc.ir import ops as O
from picc.ir.core import Op
from picc.ir.fused_ops import FusedFFN
from picc.ir.module import Function, Module
from picc.ir.types import Placement, TensorType
from picc.ir.weights import WeightStore
from picc.passes.partition_neurons import ffn_layer
from picc.placement import memory_plan as mp
from picc.placement.cost_model import cpu_weight_reads, gathered_matrices
from picc.placement.schedule import schedule
from picc.targets import Target


def _read_seconds(target: Target, where: Placement | None, parts: list[tuple[int, str]]) -> float:
    """Seconds to read ``(bytes, CPU rate key)`` parts on the device ``where``."""
    if where == Placement.GPU:
        assert target.gpu is not None
        return sum(nbytes for nbytes, _ in parts) / target.gpu.mem_bandwidth
    return target.cpu.read_seconds(parts)


def _weight_parts(op: Op, weights: WeightStore) -> list[tuple[int, str]]:
    """Each weight of ``op`` as (bytes, the rate key of the kernel reading it). A fused FFN's down
    rows are neuron-major AXPYs; a dense FFN in the source layout dots its down rows with h; a
    mixture of experts reads its router, ``top_k`` of its ``n_experts`` experts and its shared
    ones a token."""
    if isinstance(op, O.MoE):  # the experts as its kernel reads them (rows8: the 4-bit ones)
        share = (op.top_k + op.n_shared) / (op.n_experts + op.n_shared)
        rows8 = [w for w in (op.up, op.gate, op.down) if w and weights[w].dtype.value in names.NIBBLE_DTYPES]
        reads = cpu_weight_reads(weights, op.weights(), op.x_format, rows8=rows8 if op.layout == "rows8" else ())
        return [(nbytes if name == op.router else round(nbytes * share), key)
                for name, (nbytes, key) in zip(op.weights(), reads, strict=True)]
    if not isinstance(op, O.MatrixOp) or op.layout != "rows8":
        rows8: tuple[str | None, ...] = ()
    elif isinstance(op, FusedFFN):
        rows8 = names.read_whole(op.mode, op.up, op.gate)
    else:
        rows8 = op.weights()
    gathered = gathered_matrices(op.mode, op.up, op.gate, op.down) if isinstance(op, FusedFFN) else ()
    return cpu_weight_reads(weights, op.weights(), op.x_format if isinstance(op, O.MatrixOp) else "f32",
                            axpy=op.down if isinstance(op, FusedFFN) else None, rows8=rows8, gathered=gathered)


def _layer_row(i: int, name: str, layer: dict, where: dict[str, Placement | None], plan: mp.MemoryPlan) -> dict:
    """The report's row of FFN layer ``name`` (its parts, their devices and times)."""
    gpu_n = cpu_n = 0
    gpu_f = total_f = 0.0
    for _, fl, device in layer["parts"]:
        on_gpu = device == Placement.GPU
        gpu_n += fl.n_ff if on_gpu else 0
        cpu_n += 0 if on_gpu else fl.n_ff
        f = float(fl.freq.sum(dtype="float64"))
        total_f += f
        gpu_f += f if on_gpu else 0.0
    first = layer["parts"][0][0]
    index = first.block
    return {
        "layer": index if index is not None else i, "ffn": name,
        "mode": getattr(first, "mode", "dense"),
        "gpu_neurons": gpu_n, "cpu_neurons": cpu_n,
        "gpu_activation_share": gpu_f / total_f if total_f > 0 else 0.0,
        "dense_on_gpu": where.get(first.x) == Placement.GPU,
        "gpu_bytes": plan.device_bytes("gpu", layer=index), "cpu_bytes": plan.device_bytes("cpu", layer=index),
        "ffn_gpu_ms": 1e3 * layer["gpu_s"], "ffn_cpu_ms": 1e3 * layer["cpu_s"],
    }


def _transfers(func: Function, types: dict[str, TensorType], where: dict[str, Placement | None],
               target: Target) -> tuple[int, float]:
    """The PCIe transfers of one token and their seconds (each the target's latency plus its bytes
    over the link's bandwidth): a value that ops on the other device read crosses to it once a
    token, and the logits cross back when the function returns them from the GPU."""
    transfer_s, transfers = 0.0, 0
    moved: set[tuple[str, Placement | None]] = set()
    for op in func.ops:
        device = op.type.placement
        for v in op.values():
            if where.get(v) is not None and where[v] != device and (v, device) not in moved:
                moved.add((v, device))
                transfers += 1
                transfer_s += target.pcie_latency + mp.tensor_bytes(types[v], 1) / max(target.pcie_bandwidth, 1.0)
    if where.get(func.ret) == Placement.GPU:
        transfers += 1
        transfer_s += target.pcie_latency + mp.tensor_bytes(types[func.ret], 1) / max(target.pcie_bandwidth, 1.0)
    return transfers, transfer_s


def _moe_notes(func: Function) -> list[str]:
    """A line on the mixtures of experts, which the table of FFN layers does not show."""
    moes = [op for op in func.ops if isinstance(op, O.MoE)]
    if not moes:
        return []
    kinds = sorted({(op.top_k, op.n_experts, op.n_shared) for op in moes})
    return [f"{len(moes)} layer{'s' if len(moes) > 1 else ''} a mixture of experts "
            f"({', '.join(f'{k} of {n}' + (f' and {s} shared' if s else '') for k, n, s in kinds)} a token), "
            "on the CPU: dense, not in the table"]


def build_report(module: Module, weights: WeightStore, target: Target, plan: mp.MemoryPlan) -> dict:
    """The placement report (see the module docstring); ``picc inspect --json`` prints it."""
    func = module.function()
    types = func.value_types()
    where = {op.result: op.type.placement for op in func.ops}
    where.update({a.name: a.type.placement for a in func.args})

    layers: dict[str, dict] = {}  # the layer's ffn value -> its parts' numbers
    dense = {"gpu": 0.0, "cpu": 0.0}
    transfers, transfer_s = _transfers(func, types, where, target)
    launches = 0  # GPU kernel launches a token
    read_bytes = 0.0  # weights and KV cache one token reads, both devices
    cpu_keys: set[str] = set()  # the rate keys of the CPU's weight reads
    for op in func.ops:
        device = op.type.placement
        overhead = 0.0  # the fixed cost of the op's GPU kernels
        if device == Placement.GPU:
            assert target.gpu is not None
            launches += mp.gpu_launch_count(op, plan.ctx)
            overhead = mp.gpu_launch_count(op, plan.ctx) * target.gpu.kernel_overhead
        if isinstance(op, O.FFN | FusedFFN):
            key = op.layer if isinstance(op, FusedFFN) else op.part_of or op.result
            layer = layers.setdefault(key, {"gpu_s": 0.0, "cpu_s": 0.0, "parts": []})
            fl = ffn_layer(op, weights, input_on_gpu=False)
            read = fl.neuron_bytes * float(fl.read_rate().sum())
            read_bytes += read
            # The bytes read per token, at the mix of rates of the op's weights.
            parts = _weight_parts(op, weights)
            total = sum(nbytes for nbytes, _ in parts)
            seconds = read * _read_seconds(target, device, parts) / total if total else 0.0
            if device != Placement.GPU:
                cpu_keys.update(key for _, key in parts)
            layer["gpu_s" if device == Placement.GPU else "cpu_s"] += seconds + overhead
            layer["parts"].append((op, fl, device))
            continue
        if isinstance(op, O.Embed):  # one row, copied
            parts = [(int(weights[op.table].data.nbytes) // int(weights[op.table].shape[0]), "f32")]
        else:
            parts = _weight_parts(op, weights)
            if device != Placement.GPU:
                cpu_keys.update(key for _, key in parts)
        if isinstance(op, O.Attention):
            parts.append((mp.kv_cache_bytes(op, plan.ctx) // 2, op.kv_format))  # half full on average
        read_bytes += sum(nbytes for nbytes, _ in parts)
        dense["gpu" if device == Placement.GPU else "cpu"] += _read_seconds(target, device, parts) + overhead
    gpu_stages = sum(1 for st in schedule(module).stages if st.gpu)
    sync_s = gpu_stages * target.gpu.sync_overhead if target.gpu is not None else 0.0

    rows = [_layer_row(i, name, layer, where, plan) for i, (name, layer) in enumerate(layers.items())]
    ffn_s = sum(max(la["gpu_s"], la["cpu_s"]) for la in layers.values())
    total = dense["gpu"] + dense["cpu"] + ffn_s + transfer_s + sync_s
    gpu_kinds = {kind: plan.device_bytes("gpu", kind)
                 for kind in ("weight", "constant", "kv-cache", "activations", "workspace")}
    return {
        "target": target.name, "vram_budget_bytes": plan.budget, "gpu_bytes": plan.gpu_bytes,
        "cpu_bytes": plan.cpu_bytes, "gpu_bytes_by_kind": gpu_kinds, "ctx": plan.ctx,
        "notes": list(plan.notes) + _moe_notes(func), "layers": rows,
        "estimate_tokens_per_s": 1.0 / total if total > 0 else 0.0,
        "estimate_ms_per_token": {
            "total": 1e3 * total, "dense_gpu": 1e3 * dense["gpu"], "dense_cpu": 1e3 * dense["cpu"],
            "ffn": 1e3 * ffn_s, "ffn_gpu": 1e3 * sum(la["gpu_s"] for la in layers.values()),
            "ffn_cpu": 1e3 * sum(la["cpu_s"] for la in layers.values()), "transfers": 1e3 * transfer_s,
            "gpu_launches": 1e3 * launches * (target.gpu.kernel_overhead if target.gpu is not None else 0.0),
            "gpu_syncs": 1e3 * sync_s,
        },
        "transfers_per_token": transfers,
        "gpu_launches_per_token": launches,
        "gpu_stages_per_token": gpu_stages,
        "bytes_per_token": read_bytes,
        # Per rate key the CPU reads weights in: bytes/s, and as a share of the memory's bandwidth.
        "cpu_mem_bandwidth": target.cpu.mem_bandwidth,
        "cpu_read_rates": {key: {"bytes_per_s": target.cpu.read_rate(key),
                                 "bandwidth_share": target.cpu.read_rate(key) / target.cpu.mem_bandwidth}
                           for key in sorted(cpu_keys)},
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def format_report(report: dict) -> str:
    """The report as the table ``picc inspect`` prints."""
    lines = [f"target {report['target']}: VRAM budget {report['vram_budget_bytes'] / 2**20:.2f} MiB, "
             f"planned GPU {report['gpu_bytes'] / 2**20:.2f} MiB, CPU {report['cpu_bytes'] / 2**20:.2f} MiB "
             f"(ctx {report['ctx']})"]
    kinds = report["gpu_bytes_by_kind"]
    lines.append("GPU: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in kinds.items()))
    lines.extend(f"note: {n}" for n in report["notes"])
    lines.append("")
    lines.append(f"{'layer':>5} {'mode':<10} {'dense':<5} {'GPU n':>6} {'CPU n':>6} {'GPU act':>8} "
                 f"{'GPU MiB':>9} {'CPU MiB':>9} {'FFN GPU ms':>10} {'FFN CPU ms':>10}")
    for r in report["layers"]:
        lines.append(f"{r['layer']:>5} {r['mode']:<10} {'GPU' if r['dense_on_gpu'] else 'CPU':<5} "
                     f"{r['gpu_neurons']:>6} {r['cpu_neurons']:>6} {100 * r['gpu_activation_share']:7.1f}% "
                     f"{_mib(r['gpu_bytes'])} {_mib(r['cpu_bytes'])} {r['ffn_gpu_ms']:10.4f} {r['ffn_cpu_ms']:10.4f}")
    est = report["estimate_ms_per_token"]
    lines.append("")
    lines.append(f"estimate: {report['estimate_tokens_per_s']:.1f} tokens/s ({est['total']:.3f} ms/token: dense "
                 f"GPU {est['dense_gpu']:.3f} + dense CPU {est['dense_cpu']:.3f} + FFN {est['ffn']:.3f} "
                 f"(GPU {est['ffn_gpu']:.3f} || CPU {est['ffn_cpu']:.3f}) + {report['transfers_per_token']} "
                 f"transfers {est['transfers']:.3f} + {report.get('gpu_stages_per_token', 0)} GPU stage syncs "
                 f"{est.get('gpu_syncs', 0.0):.3f})")
    if report.get("gpu_launches_per_token"):
        lines.append(f"GPU: {report['gpu_launches_per_token']} kernel launches a token, {est['gpu_launches']:.3f} ms "
                     "of it their fixed cost (in the GPU terms above)")
    if report.get("cpu_only_estimate_tokens_per_s"):
        lines.append(f"the same model on the CPU alone: {report['cpu_only_estimate_tokens_per_s']:.1f} tokens/s "
                     "estimated")
    if report.get("dense_estimate_tokens_per_s"):  # a sparse CPU-only compile, weighed against --dense
        lines.append(f"the same model compiled --dense: {report['dense_estimate_tokens_per_s']:.1f} tokens/s "
                     "estimated")
    if report.get("sparse_estimate_tokens_per_s"):  # the dense model, chosen over the sparse one
        lines.append(f"the same model compiled sparse (--sparse): {report['sparse_estimate_tokens_per_s']:.1f} "
                     "tokens/s estimated")
    if report.get("sparse_estimate_at_most_tokens_per_s"):  # the dense model, chosen before profiling
        lines.append("a sparse model (not profiled): at most "
                     f"{report['sparse_estimate_at_most_tokens_per_s']:.1f} tokens/s estimated")
    rates = report.get("cpu_read_rates", {})  # absent in reports of .pib files from before it
    if rates:
        listed = ", ".join(f"{key} {r['bytes_per_s'] / 1e9:.1f} GB/s ({100 * r['bandwidth_share']:.0f}%)"
                           for key, r in rates.items())
        lines.append(f"CPU kernels read weights at: {listed} of the memory's "
                     f"{report['cpu_mem_bandwidth'] / 1e9:.1f} GB/s")
    return "\n".join(lines)


def plot_report(report: dict, path) -> None:  # noqa: ANN001 - a path
    """Per layer: GPU / CPU neurons and the GPU's activation share, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from picc.fsutil import atomic_path

    rows = report["layers"]
    x = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.3), 4))
    ax.bar(x, [r["gpu_neurons"] for r in rows], label="GPU neurons", color="tab:green")
    ax.bar(x, [r["cpu_neurons"] for r in rows], bottom=[r["gpu_neurons"] for r in rows], label="CPU neurons",
           color="tab:gray")
    ax.set_xlabel("layer")
    ax.set_ylabel("neurons")
    share = ax.twinx()
    share.plot(x, [100 * r["gpu_activation_share"] for r in rows], "o-", color="tab:red",
               label="GPU share of activations")
    share.set_ylim(0, 100)
    share.set_ylabel("% of activations on the GPU")
    ax.set_title(f"{report['target']}: {report['gpu_bytes'] / 2**20:.1f} of "
                 f"{report['vram_budget_bytes'] / 2**20:.1f} MiB VRAM, "
                 f"~{report['estimate_tokens_per_s']:.0f} tokens/s estimated")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
