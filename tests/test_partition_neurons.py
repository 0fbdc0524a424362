"""The partition-neurons pass and the memory plan: budgets, placement in the IR, exact numerics.

Numerics: a split layer computes its hot and cold neurons as two partial sums that are added,
where the unsplit layer sums all neurons in one product. That reorders float32 additions, so
logits agree to rounding: relative max error <= 1e-5 (float32 epsilon is 1.2e-7; a few hundred
terms per dot product and a handful of layers stay orders of magnitude below the bound).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_llama, with_tokenizer

from picc.errors import PiccError
from picc.frontend import load_model
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.parser import parse
from picc.ir.printer import print_module
from picc.ir.types import DType, Placement
from picc.ir.verifier import VerifyError, verify
from picc.passes import parse_pipeline, run_pipeline
from picc.placement.memory_plan import plan_memory, tensor_bytes
from picc.placement.plan_report import build_report, format_report
from picc.placement.schedule import schedule
from picc.targets import load_target
from runtime.plan import ARENA_ALIGN as ALIGN

REL = 1e-5


def partition(module, weights, **options):
    text = ",".join(f"{k}={v}" for k, v in options.items())
    return run_pipeline(module, weights, parse_pipeline(f"partition-neurons{{{text}}}"))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def plan_of(module, weights):
    attrs = dict(module.attrs)
    return plan_memory(module, weights, ctx=attrs["ctx"], budget=attrs["vram_budget"])


@pytest.fixture(scope="module")
def relu_demo_sparse():
    """relu-demo, neuron-major, profiled on 512 PTB tokens, gate-first (exact for ReGLU)."""
    model = load_model("relu-demo")
    pipeline = parse_pipeline("neuron-major-down,profile-activations{tokens=512},insert-predictors{mode=gate-first}")
    return model, run_pipeline(model.module, model.weights, pipeline, tokenizer=model.tokenizer)


def sparse_tiny(form: str, mode: str, tmp_path_factory):
    model = with_tokenizer(tiny_llama(form, n_layers=3, hidden=64, n_ff=128))
    options = f"mode={mode},tokens=512" + (",cache=off" if mode == "predictor" else "")
    target = "" if form == "relu" else ",target-sparsity=0.4"
    pipeline = parse_pipeline(f"neuron-major-down,profile-activations{{tokens=512,window=64{target}}},"
                              f"insert-predictors{{{options}}}")
    return model, run_pipeline(model.module, model.weights, pipeline, tokenizer=model.tokenizer)


@pytest.mark.parametrize(("form", "mode"), [("relu", "predictor"), ("swiglu", "gate-first"),
                                            ("swiglu", "down-only"), ("swiglu", "dense")])
def test_partitioned_logits_equal_the_unpartitioned_sparse_ir(form, mode, tmp_path_factory):
    model, sparse = sparse_tiny(form, mode, tmp_path_factory)
    tokens = np.arange(3, 40) % 128
    reference = Interpreter(sparse, model.weights).run(tokens)
    total = plan_of(partition(sparse, model.weights, target="pc-low", vram="1GB"), model.weights).gpu_bytes
    split_seen = False
    for share in (0.0, 0.75, 0.85, 0.95, 1.0):
        placed = partition(sparse, model.weights, target="pc-low", vram=int(share * total))
        split_seen |= any(op.part_of is not None for op in placed.ops() if isinstance(op, O.FFN))
        assert parse(print_module(placed)) == placed
        assert rel_err(Interpreter(placed, model.weights).run(tokens), reference) <= REL, share
        if mode == "down-only":  # no GPU kernel: every FFN stays whole on the CPU
            assert all(op.type.placement == Placement.CPU for op in placed.ops() if isinstance(op, O.FFN))
    if mode == "down-only":
        assert not split_seen
    else:
        assert split_seen, "no budget split a layer: the test would not test permutation"


def test_split_layers_are_permuted_by_frequency_and_typed_by_device(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    placed = partition(sparse, model.weights, target="pc-low", vram="9MB")
    verify(placed)
    parts = [op for op in placed.ops() if isinstance(op, O.FFN) and op.part_of]
    assert parts, "9MB should split some layers"
    for hot in (op for op in parts if op.result.endswith(".hot")):
        cold = next(op for op in parts if op.part_of == hot.part_of and op.result.endswith(".cold"))
        assert hot.type.placement == Placement.GPU and cold.type.placement == Placement.CPU
        n_hot = model.weights[hot.up].shape[0]
        assert cold.neuron_offset == n_hot
        # Every GPU neuron fires at least as often as every CPU neuron of the layer.
        assert model.weights.f32(hot.freq).min() >= model.weights.f32(cold.freq).max()
        for name in (hot.up, hot.gate, hot.down):
            assert placed.weight_types()[name].placement == Placement.GPU
        merge = next(op for op in placed.ops() if op.result == hot.part_of)
        assert isinstance(merge, O.Add) and {merge.a, merge.b} == {hot.result, cold.result}


def test_budget_sweep_never_exceeds_the_budget_and_the_gpu_share_only_grows(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    target = load_target("pc-low")
    everything = plan_of(partition(sparse, model.weights, target="pc-low", vram="1GB"), model.weights).gpu_bytes
    previous = None
    for budget in [0, 1, 10**5] + [int(f * everything) for f in np.linspace(0.05, 1.1, 22)]:
        placed = partition(sparse, model.weights, target="pc-low", vram=budget)
        plan = plan_of(placed, model.weights)
        assert plan.gpu_bytes <= budget
        report = build_report(placed, model.weights, target, plan)
        shares = np.array([la["gpu_activation_share"] for la in report["layers"]])
        if previous is not None:
            assert np.all(shares >= previous - 1e-12), budget
        previous = shares
    assert np.all(previous == 1.0)  # past the model's size everything is on the GPU


def test_memory_plan_buffers_are_aligned_and_disjoint(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    placed = partition(sparse, model.weights, target="pc-low", vram="9MB")
    plan = plan_of(placed, model.weights)
    gpu = sorted((b for b in plan.buffers if b.device == "gpu"), key=lambda b: b.offset)
    assert {b.kind for b in gpu} == {"weight", "constant", "kv-cache", "activations", "workspace"}
    for a, b in zip(gpu, gpu[1:], strict=False):
        assert a.offset % ALIGN == 0 and a.offset + a.nbytes <= b.offset
    declared_gpu = {w.name for w in placed.weights if w.type.placement == Placement.GPU}
    assert declared_gpu == {b.name for b in gpu if b.kind == "weight"}
    # KV cache of a GPU layer: ctx positions of K and V, f32, width n_kv_heads * head_dim = 64.
    kv = next(b for b in gpu if b.kind == "kv-cache")
    assert kv.nbytes == 2 * 512 * 64 * 4
    # Activation slots: values alive at the same time never overlap. The GPU runs its ops in
    # order; a value copied in from the CPU (or a function argument) arrives before the first GPU
    # op of the stage that reads it (its schedule's copy), and one copied out leaves before the
    # first GPU op of the stage that reads it on the CPU.
    func = placed.function()
    types = func.value_types()
    steps = schedule(placed)
    order = {op.result: i for i, op in enumerate(func.ops)}

    def stage_start(k: int) -> int:
        return min((order[g] for st in steps.stages[k:] for g in st.gpu), default=len(func.ops))

    start = {op.result: i for i, op in enumerate(func.ops) if op.type.placement == Placement.GPU}
    start.update({a.name: 0 for a in func.args})
    end = {v: i for i, op in enumerate(func.ops) if op.type.placement == Placement.GPU for v in op.values()}
    end[func.ret] = len(func.ops)
    for k, st in enumerate(steps.stages):
        start.update({v: stage_start(k) for v in st.to_gpu})
        end.update({v: max(end.get(v, 0), stage_start(k)) for v in st.to_cpu})
    arena = next(b for b in gpu if b.kind == "activations")
    slots = [(v, off, off + tensor_bytes(types[v], 1)) for v, off in plan.activation_offsets.items()]
    # What the GPU reads from the CPU has a slot too: the positions, and the embedding (computed
    # on the CPU here, since the LM head that shares its table is not on the GPU at 9MB).
    assert {"pos", "embed"} <= set(plan.activation_offsets)
    for v, lo, hi in slots:
        assert hi <= arena.nbytes
        for w, lo2, hi2 in slots:
            if v < w and start[v] <= end[w] and start[w] <= end[v]:
                assert hi <= lo2 or hi2 <= lo, (v, w)


def test_small_budgets_keep_whole_layers_dense_on_the_cpu(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    placed = partition(sparse, model.weights, target="pc-low", vram="3MB")
    plan = plan_of(placed, model.weights)
    on_gpu = {int(op.result[1]) for op in placed.ops() if op.result.startswith("l") and op.type.placement == Placement.GPU}
    assert on_gpu and on_gpu == set(range(len(on_gpu)))  # a prefix of the layers
    assert not any(op.type.placement == Placement.GPU for op in placed.ops() if isinstance(op, O.FFN))
    assert any("attention and norms on the CPU" in n for n in plan.notes)


def test_cpu_target_places_nothing_on_the_gpu(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    placed = partition(sparse, model.weights, target="cpu")
    assert "@gpu" not in print_module(placed)
    assert plan_of(placed, model.weights).gpu_bytes == 0
    with pytest.raises(PiccError, match="has no GPU"):
        partition(sparse, model.weights, target="cpu", vram="1GB")


def test_a_budget_over_the_gpus_memory_is_refused(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    with pytest.raises(PiccError, match=r"vram 12GiB: 12.0 GiB is more than the 11.0 GiB of the NVIDIA GeForce RTX 2080 Ti of target pc-low"):
        partition(sparse, model.weights, target="pc-low", vram="12GiB")
    partition(sparse, model.weights, target="pc-low", vram="11GiB")  # all of it is fine


def test_splitting_needs_neuron_major_down():
    model = with_tokenizer(tiny_llama("reglu", n_layers=1, hidden=64, n_ff=128))
    sparse = run_pipeline(model.module, model.weights, parse_pipeline(
        "profile-activations{tokens=256,window=64},insert-predictors{mode=gate-first}"), tokenizer=model.tokenizer)
    with pytest.raises(PiccError, match="run neuron-major-down before partition-neurons"):
        partition(sparse, model.weights, target="pc-low", vram="1GB")
    assert "@gpu" not in print_module(partition(sparse, model.weights, target="pc-low", vram=0))


def test_verifier_refuses_a_gpu_op_reading_a_cpu_weight(relu_demo_sparse):
    model, sparse = relu_demo_sparse
    placed = partition(sparse, model.weights, target="pc-low", vram="1GB")
    text = print_module(placed).replace("weight @l0.attn.q : f16[320, 320] @gpu", "weight @l0.attn.q : f16[320, 320] @cpu")
    with pytest.raises(VerifyError, match=r"%l0.attn.q = linear: the op runs @gpu but its weight @l0.attn.q is @cpu"):
        verify(parse(text))


def test_neuron_major_down_is_exact_for_floats_and_one_step_for_quantized():
    model = tiny_llama("swiglu", n_layers=1)
    tokens = np.arange(1, 20)
    before = Interpreter(model.module, model.weights).run(tokens)
    after = run_pipeline(model.module, model.weights, parse_pipeline("neuron-major-down"))
    assert all(op.neuron_major for op in after.ops() if isinstance(op, O.FFN))
    np.testing.assert_array_equal(Interpreter(after, model.weights).run(tokens), before)
    q = tiny_llama("swiglu", n_layers=1, matrix_dtype=DType.Q8_0)
    transposed = run_pipeline(q.module, q.weights, parse_pipeline("neuron-major-down"))
    ffn = next(op for op in transposed.ops() if isinstance(op, O.FFN))
    assert transposed.weight_types()[ffn.down].dtype.value == "q8_0"
    # Requantising along the other axis moves each weight by at most half a q8_0 step (a block's
    # max / 127, at most the matrix's max / 127) plus the f16 rounding of the block scale
    # (127 * 2^-11 of a step): 0.6 steps bounds it.
    old = next(op for op in q.module.ops() if isinstance(op, O.FFN))
    diff = np.abs(q.weights.f32(ffn.down) - q.weights.f32(old.down).T)
    step = np.abs(q.weights.f32(old.down)).max() / 127
    assert 0 < diff.max() <= 0.6 * step


@pytest.mark.parametrize("layout", ["source", "neuron-major"])
def test_the_estimate_reads_cpu_weights_no_faster_than_their_kernels(layout, tmp_path):
    """The report's CPU time is each weight's bytes over min(bandwidth, its kernel's rate): the
    target's kernel rates slow exactly the weights their kernels read, no others."""
    import yaml

    from picc.ir.fused_ops import FusedFFN

    bw = 20e9
    model = tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_1)
    steps = "canonicalize," + ("neuron-major-down," if layout == "neuron-major" else "")

    def report(rates: dict[str, float]):
        cpu = {"name": "test CPU", "cores": 2, "mem_bandwidth": bw, "simd": "avx2", "kernel_rates": rates}
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump({"name": "t", "gpu": None, "cpu": cpu}))
        weights = model.weights.copy()
        module = run_pipeline(model.module, weights, parse_pipeline(
            f"{steps}partition-neurons{{target={path}}},fuse-gather-gemv,select-kernels"))
        return module, weights, build_report(module, weights, load_target(str(path)), plan_of(module, weights))

    module, weights, base = report({})
    ops = [op for op in module.ops() if not isinstance(op, O.Embed)]
    q4 = [(op, w) for op in ops for w in op.weights() if weights[w].dtype == DType.Q4_1]
    q4_bytes = sum(int(weights[w].data.nbytes) for _, w in q4)
    # A dense q4_1 model dots x rounded to int16 (the _xi16 kernels; GEMVs and FFNs in the source
    # layout eight rows at a time, _r8_xi16); a fused FFN's down rows, neuron-major, are AXPYs of h
    # at the float rate. In the source layout down is dotted too.
    assert all(op.x_format == "i16" for op, _ in q4)
    assert all((op.layout == "rows8") != isinstance(op, FusedFFN) for op, _ in q4)
    every = {"q4_1", "q4_1_xi16", "q4_1_r8_xi16"}
    axpy_bytes = sum(int(weights[w].data.nbytes) for op, w in q4 if isinstance(op, FusedFFN) and w == op.down)
    assert (axpy_bytes > 0) == (layout == "neuron-major") and axpy_bytes < q4_bytes

    def extra_ms(rates: dict[str, float]) -> float:
        return report(rates)[2]["estimate_ms_per_token"]["total"] - base["estimate_ms_per_token"]["total"]

    assert extra_ms(dict.fromkeys(every, 1e15)) == pytest.approx(0.0, abs=1e-12)  # memory-bound
    assert extra_ms(dict.fromkeys(every, bw / 4)) == pytest.approx(1e3 * 3 * q4_bytes / bw, rel=1e-9)
    assert extra_ms({"q4_1": bw / 4}) == pytest.approx(1e3 * 3 * axpy_bytes / bw, rel=1e-9, abs=1e-12)
    slow = report({"q4_1_r8_xi16": bw / 4})[2]
    rates = slow["cpu_read_rates"]
    assert rates["q4_1_r8_xi16"] == {"bytes_per_s": bw / 4, "bandwidth_share": 0.25}
    assert ("q4_1" in rates) == ("q4_1_xi16" in rates) == (layout == "neuron-major")
    assert "q4_1_r8_xi16 5.0 GB/s (25%)" in format_report(slow) and "memory's 20.0 GB/s" in format_report(slow)


def test_the_partitioner_reads_cpu_ffn_weights_at_their_kernels_rate(tmp_path):
    """Each FFN weight at min(bandwidth, the rate of the kernel that will read it): int16 dots
    for up and gate in a module that decides no sparsity, float ones where it does (a gate-first
    gate eight rows at a time from the rows8 layout), and AXPYs (float) for the neuron-major down
    rows; a sparse FFN's gathered rows (gate-first's up and down) at its fused kernel's rate."""
    import yaml

    from picc.passes.partition_neurons import ffn_cpu_read_rate
    from picc.placement.partition.problem import DeviceCosts

    bw = 20e9
    cpu = {"name": "test CPU", "cores": 2, "mem_bandwidth": bw, "simd": "avx2",
           "kernel_rates": {"q4_1": bw / 4, "q4_1_xi16": bw / 2, "q4_1_r8": bw / 3, "q4_1_gathered": bw / 5}}
    path = tmp_path / "t.yaml"
    gpu = {"name": "Some GPU", "arch": "sm_75", "vram": "1GiB", "mem_bandwidth": "616GB/s"}
    path.write_text(yaml.safe_dump({"name": "t", "gpu": gpu, "pcie_bandwidth": "12GB/s", "cpu": cpu}))
    target = load_target(str(path))
    model = with_tokenizer(tiny_llama("swiglu", n_layers=2, hidden=64, n_ff=128, matrix_dtype=DType.Q4_1))
    dense = run_pipeline(model.module, model.weights, parse_pipeline("neuron-major-down"))
    # up, gate and down are the same size: two thirds at bw / 2, one third at bw / 4.
    assert ffn_cpu_read_rate(dense, model.weights, target) == pytest.approx(bw / (2 / 3 * 2 + 1 / 3 * 4))
    sparse = run_pipeline(model.module, model.weights, parse_pipeline(
        "neuron-major-down,profile-activations{tokens=256,window=64,target-sparsity=0.4},"
        "insert-predictors{mode=gate-first}"), tokenizer=model.tokenizer)
    # up and down (gathered rows, dotted and AXPYs) at bw / 5, the gate at bw / 3.
    assert ffn_cpu_read_rate(sparse, model.weights, target) == pytest.approx(bw / (2 / 3 * 5 + 1 / 3 * 3))
    assert ffn_cpu_read_rate(dense, model.weights, load_target("pc-low")) == load_target("pc-low").cpu.mem_bandwidth
    assert DeviceCosts.for_target(target, 64, cpu_read_rate=bw / 4).cpu_bandwidth == bw / 4
    assert DeviceCosts.for_target(target, 64).cpu_bandwidth == bw
