"""The CUDA executor without a GPU: ``runtime.cuda`` against a stand-in driver (``cuda_fake``).

The stand-in keeps the rules a real driver enforces -- a current context per thread, streams that
run their work only when waited for, graphs that replay what was captured -- and runs each launch
through the host build of the same kernels, so the executor's context handling, argument
bindings, asynchronous copies and CUDA graphs are checked by the logits they produce (the
interpreter's, to the hybrid tests' 1e-3) on machines without a GPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import half_the_ffn, tiny_llama, with_tokenizer
from cuda_fake import FakeCuda

import runtime.cuda
import runtime.executor
import runtime.hostmem
from picc.codegen_cuda import nvcc_path
from picc.compile import CompileOptions, compile_model, write_compiled
from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.types import Placement
from picc.pib import load_pib
from picc.placement import memory_plan as mp
from picc.sparsity.sparsify import SparsifyOptions
from runtime.contracts import ContractError, CudaManifest, Schedule, launches_from_json, launches_to_json
from runtime.pib import PibFile
from runtime.session import Session

pytestmark = pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed: the .pib would carry no PTX")

TOKENS = [1, 5, 9, 2, 17, 33, 4, 60, 8, 3]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def pibs(tmp_path_factory):
    """A tiny ReGLU model in predictor mode for pc-low: split (part of each FFN on the GPU, so the
    GPU's ops run on the executor's worker thread beside the CPU's) and whole on the GPU."""
    root = tmp_path_factory.mktemp("cuda_host")
    model = with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, seed=5))
    sparsity = SparsifyOptions(mode="predictor", tokens=512, window=64, budget=0.5)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICC_CACHE_DIR", str(root / "cache"))
        whole = compile_model(model, CompileOptions(target="pc-low", vram="4MiB", sparsity=sparsity),
                              say=lambda _: None)
        split = compile_model(model, CompileOptions(target="pc-low", vram=str(half_the_ffn(whole)), sparsity=sparsity),
                              say=lambda _: None)
        # Tied embeddings: the embedding sits beside the LM head on the GPU, so the whole step is
        # the GPU's (the greedy loop's case).
        tied = compile_model(with_tokenizer(tiny_llama("reglu", n_layers=2, hidden=64, n_ff=128, seed=5, tied=True)),
                             CompileOptions(target="pc-low", vram="4MiB", sparsity=sparsity), say=lambda _: None)
        for name, result in (("whole", whole), ("split", split), ("tied", tied)):
            out[name] = root / f"{name}.pib"
            write_compiled(result, out[name])
        for mode, form, dense in (("gate-first", "swiglu", False), ("gate-first", "swiglu", True)):
            glu = with_tokenizer(tiny_llama(form, n_layers=2, hidden=64, n_ff=128, seed=5))
            options = CompileOptions(target="pc-low", vram="4MiB", dense=dense,
                                     sparsity=SparsifyOptions(mode=mode, tokens=512, window=64, budget=0.5))
            out["dense" if dense else mode] = root / f"{'dense' if dense else mode}.pib"
            write_compiled(compile_model(glu, options, say=lambda _: None), out["dense" if dense else mode])
    stages = PibFile(out["split"]).json("schedule")["stages"]
    assert any(st["cpu"] and st["gpu"] for st in stages), "no stage of the split model runs on both devices"
    return out


class Fakes(list):
    """The stand-in drivers the sessions of a test opened, and whether their executors use graphs."""

    graphs = True


@pytest.fixture()
def fake_driver(monkeypatch):
    """Make sessions find one CUDA device whose driver is a :class:`FakeCuda` of the file opened."""
    fakes = Fakes()

    def make_gpu(pib: PibFile, mode: str):  # noqa: ANN202
        fakes.append(FakeCuda(pib))
        return runtime.cuda.CudaGpu(pib, driver=runtime.cuda.Driver(fakes[-1]), graphs=fakes.graphs)

    monkeypatch.setattr(runtime.executor, "_make_gpu", make_gpu)
    return fakes


@pytest.mark.parametrize("name", ["split", "whole", "gate-first", "dense"])
def test_logits_through_the_cuda_executor_match_the_interpreter(pibs, fake_driver, name):
    pib = load_pib(pibs[name])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(pibs[name], threads=2, gpu="cuda") as session:
        assert session.executor.gpu_kind == "cuda"
        logits = np.stack([_step(session, t) for t in TOKENS])
    assert rel_err(logits, reference) <= 1e-3
    assert fake_driver[0].kernel_runs > 0


def _step(session: Session, token: int) -> np.ndarray:
    session.executor.step(token, session.pos)
    session.pos += 1
    return session.executor.logits().copy()


def test_a_thread_other_than_the_opener_calls_the_driver_with_its_context_current(pibs, fake_driver):
    """Steps may run on another thread than the one that opened the session (a server's engine
    thread does), where no context is current until the executor makes it so (the real driver
    answers CUDA_ERROR_INVALID_CONTEXT there; a split model's prompt once failed so on the
    executor's worker thread)."""
    pib = load_pib(pibs["split"])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(pibs["split"], threads=2, gpu="cuda") as session:
        out: list[np.ndarray] = []
        worker = threading.Thread(target=lambda: out.append(session.feed(TOKENS, all_logits=True)), name="other")
        worker.start()
        worker.join()
    on_other = {call for thread, call in fake_driver[0].calls if thread == "other"}
    assert {"cuCtxSetCurrent", "cuLaunchKernel", "cuEventSynchronize"} <= on_other
    assert out and rel_err(out[0], reference) <= 1e-3


def test_repeated_stages_replay_captured_graphs(pibs, fake_driver):
    """From the second token on, each stage's kernels are one graph launch, not one launch each."""
    with Session(pibs["whole"], threads=1, gpu="cuda") as session:
        gpu = session.executor.gpu
        _step(session, TOKENS[0])
        first = gpu.times.launches
        assert first > 0 and gpu.times.graph_launches == 0
        _step(session, TOKENS[1])  # captured and replayed
        _step(session, TOKENS[2])
        stages = sum(1 for st in session.executor.stages if st.gpu)
        assert gpu.times.launches == first
        assert gpu.times.graph_launches == 2 * stages


def test_greedy_tokens_with_and_without_graphs_agree(pibs, fake_driver):
    runs = []
    for graphs in (True, False):
        fake_driver.graphs = graphs
        with Session(pibs["split"], threads=2, gpu="cuda") as session:
            runs.append(list(session.generate(TOKENS[:4], 12, stop_at_eos=False)))
    assert runs[0] == runs[1]


def test_the_cost_model_counts_the_launches_the_lowering_emits(pibs):
    """``memory_plan.gpu_launch_count``, which the cost model prices at the target's fixed cost a
    kernel, is the number of launches the GPU code has for each op, in every FFN mode. Attention at
    the default context is the one-launch decode kernel, its cache append done by its k rope's
    launch."""
    for path in pibs.values():
        pib = PibFile(path)
        manifest, launches, ctx = pib.json("cuda/manifest"), pib.json("gpu/launches"), pib.plan().ctx
        ops = [op for op in load_pib(path).module.ops() if op.type.placement == Placement.GPU]
        assert ops and any(isinstance(op, O.Attention) for op in ops)
        for op in ops:
            emitted = sum(len(manifest["kernels"][call["kernel"]]) for call in launches.get(op.result, ()))
            assert mp.gpu_launch_count(op, ctx) == emitted, (path.name, op.result)
            if isinstance(op, O.Attention):
                assert op.appended_by_rope and emitted == 1, (path.name, op.result)


@pytest.mark.parametrize("ctx", [512, 8192])
def test_attention_is_one_kernel_where_its_block_holds_the_cache_and_five_beyond(pibs, ctx):
    """The whole model's module lowered at a context its decode attention kernel takes (512) and
    at one it does not (8192): the kernel's launches are what ``gpu_launch_count`` says, and only
    the five-launch kernel gets (and the plan's workspace holds) scores and probabilities."""
    from picc.codegen_cuda import thread_extents
    from picc.codegen_cuda.lower import lower_gpu
    from picc.codegen_cuda.schedules import schedule

    model = load_pib(pibs["whole"])
    plan = mp.plan_memory(model.module, model.weights, ctx=ctx, budget=1 << 40)
    program = lower_gpu(model.module, model.weights, plan)
    attention = [op for op in model.module.ops() if isinstance(op, O.Attention)]
    assert attention and all(op.type.placement == Placement.GPU for op in attention)
    fused = ctx == 512
    workspace = next(b for b in plan.buffers if b.name == "workspace")
    for op in attention:
        calls = program.launches[op.result]
        kernels = [program.kernels[c.kernel] for c in calls]
        assert op.appended_by_rope  # its k rope's launch writes the cache rows: no kv_append of its own
        assert [k.kind for k in kernels] == ["attention_decode" if fused else "attention"]
        launches = sum(len(thread_extents(schedule(k, "sm_90"))) for k in kernels)
        assert launches == mp.gpu_launch_count(op, ctx) == (1 if fused else 5)
        params = [a.param for a in calls[-1].args]
        scratch = ["scores", "smax", "ssum", "probs"]
        assert params == ["q", "pos", "k_cache", "v_cache", *([] if fused else scratch), "out"]
        names = [name for name, _ in mp.gpu_scratch(op, ctx, model.module.weight_types())]
        assert names == ([] if fused else scratch)
        for a in calls[-1].args:
            if a.param in scratch:
                assert workspace.offset <= a.offset and a.offset + a.nbytes <= workspace.offset + workspace.nbytes


def test_launch_times_cover_a_step_launch_by_launch(pibs, fake_driver):
    with Session(pibs["whole"], threads=1, gpu="cuda") as session:
        session.feed(TOKENS[:3])
        ex = session.executor
        ops = [op for st in ex.stages for op in st.gpu]
        timed = ex.gpu.launch_seconds(ops, before=lambda: ex._inputs(5, session.pos), repeat=2)
        pib = PibFile(pibs["whole"])
        manifest, launches = pib.json("cuda/manifest"), pib.json("gpu/launches")
    expected = [(op, la["entry"]) for op in ops for call in launches.get(op, ())
                for la in manifest["kernels"][call["kernel"]]]
    assert [(op, entry) for op, entry, _ in timed] == expected
    assert all(seconds > 0 for _, _, seconds in timed)


def test_the_sections_the_runtime_reads_round_trip_through_their_records(pibs):
    """``schedule``, ``gpu/launches`` and ``cuda/manifest`` as picc compile wrote them are exactly
    what their typed records serialize to (one serializer, both sides), and a section missing a
    field is refused by name."""
    for path in pibs.values():
        pib = PibFile(path)
        schedule, launches, manifest = (pib.json(s) for s in ("schedule", "gpu/launches", "cuda/manifest"))
        assert Schedule.from_json(schedule).to_json() == schedule
        assert launches_to_json(launches_from_json(launches)) == launches
        assert CudaManifest.from_json(manifest).to_json() == manifest
    broken = {k: v for k, v in schedule.items() if k != "head"}
    with pytest.raises(ContractError, match="schedule: missing 'head'"):
        Schedule.from_json(broken)


def test_a_stage_is_queued_and_the_cpu_runs_before_the_gpu_is_waited_for(pibs, fake_driver, monkeypatch):
    """A decode step on a CUDA device queues each stage's GPU work and runs the CPU's part of the
    stage on the caller's thread without waiting for it (no hand-off to a worker thread): when a
    stage's CPU program starts, none of that stage's kernels has run yet, and all have when the
    step returns. (The stand-in device runs queued work only when it is waited for.)"""
    launches = PibFile(pibs["split"]).json("gpu/launches")
    with Session(pibs["split"], threads=2, gpu="cuda") as session:
        ex, fake = session.executor, fake_driver[0]
        session.feed(TOKENS[:3])
        started: dict[int, int] = {}  # stage -> kernels run when its CPU program started
        run_stage = ex.cpu.run_stage

        def spy(i: int, skip_head: bool) -> None:
            started[i] = fake.kernel_runs
            run_stage(i, skip_head)

        monkeypatch.setattr(ex.cpu, "run_stage", spy)
        before, calls = fake.kernel_runs, len(fake.calls)
        ex.step(TOKENS[3], session.pos)
        threads = {thread for thread, _ in fake.calls[calls:]}
        after = fake.kernel_runs
    assert threads == {"MainThread"}
    kernels = [sum(len(launches.get(op, ())) for op in st.gpu) for st in ex.stages]  # host calls a stage
    both = [i for i, st in enumerate(ex.stages) if st.gpu and st.cpu]
    assert both
    for i in both:
        assert started[i] <= before + sum(kernels[:i]), f"stage {i}'s kernels ran before its CPU part started"
    assert after == before + sum(kernels)


@pytest.mark.parametrize("name", ["split", "whole"])
def test_a_decode_step_is_graph_launches_and_waits_copies_included(pibs, fake_driver, name):
    """Once its stages are captured, a decode step makes no copy and no kernel launch of its own:
    the stages' copies in and out are nodes of their graphs (each such driver call costs the
    host ~17 us on an H100), and the logits still equal the interpreter's."""
    pib = load_pib(pibs[name])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS[:5])
    with Session(pibs[name], threads=2, gpu="cuda") as session:
        logits = [_step(session, t) for t in TOKENS[:4]]
        fake = fake_driver[0]
        calls = len(fake.calls)
        logits.append(_step(session, TOKENS[4]))
        made = {call for _, call in fake.calls[calls:]}
        stages = [st for st in session.executor.stages if st.gpu or st.to_gpu or st.to_cpu]
        graphs = sum(1 for _, call in fake.calls[calls:] if call == "cuGraphLaunch")
    assert rel_err(np.stack(logits), reference) <= 1e-3
    assert not made & {"cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuLaunchKernel"}, made
    assert 1 <= graphs <= len(stages)


@pytest.mark.parametrize(("arch", "env", "expected"), [("sm_90", None, True), ("sm_90", "0", False),
                                                       ("sm_75", None, False)])
def test_kernels_go_out_as_dependent_launches_on_sm_90(pibs, monkeypatch, arch, env, expected):
    """The file's kernels wait for their predecessors themselves (``dependent_launch``), so on a
    device of compute capability 9.0 or newer every kernel is launched with programmatic stream
    serialization (``cuLaunchKernelEx``), and the logits stay the interpreter's; PICC_CUDA_PDL=0
    and older devices launch as usual."""
    assert PibFile(pibs["whole"]).json("cuda/manifest")["dependent_launch"]
    if env is not None:
        monkeypatch.setenv("PICC_CUDA_PDL", env)
    fakes = []

    def make_gpu(pib: PibFile, mode: str):  # noqa: ANN202
        fakes.append(FakeCuda(pib, arch=arch))
        return runtime.cuda.CudaGpu(pib, driver=runtime.cuda.Driver(fakes[-1]))

    monkeypatch.setattr(runtime.executor, "_make_gpu", make_gpu)
    pib = load_pib(pibs["split"])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS[:4])
    with Session(pibs["split"], threads=2, gpu="cuda") as session:
        logits = np.stack([_step(session, t) for t in TOKENS[:4]])
        assert session.executor.gpu.dependent_launch == expected
    assert rel_err(logits, reference) <= 1e-3
    plain = sum(1 for _, call in fakes[0].calls if call == "cuLaunchKernel")
    # The first kernel after a stage's copies goes out plainly: its wait would not cover them.
    assert (fakes[0].dependent_launches > plain > 0) if expected else (fakes[0].dependent_launches == 0)


def test_a_driver_that_refuses_dependent_launches_gets_plain_ones(pibs, monkeypatch):
    """If the driver refuses the launch attribute, the executor says why and launches as usual."""
    class Refusing(FakeCuda):
        def _cuLaunchKernelEx(self, *args: object) -> int:
            return 1  # CUDA_ERROR_INVALID_VALUE

    def make_gpu(pib: PibFile, mode: str):  # noqa: ANN202
        return runtime.cuda.CudaGpu(pib, driver=runtime.cuda.Driver(Refusing(pib, arch="sm_90")))

    monkeypatch.setattr(runtime.executor, "_make_gpu", make_gpu)
    pib = load_pib(pibs["whole"])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS[:3])
    with Session(pibs["whole"], threads=1, gpu="cuda") as session:
        logits = np.stack([_step(session, t) for t in TOKENS[:3]])
        gpu = session.executor.gpu
        assert not gpu.dependent_launch and "cuLaunchKernelEx" in gpu.dependent_launch_error
    assert rel_err(logits, reference) <= 1e-3


@pytest.mark.parametrize("name", ["split", "whole"])
def test_a_decode_steps_copies_read_and_write_the_cpus_memory_in_place(pibs, fake_driver, monkeypatch, name):
    """The executor page-locks the CPU executor's memory where the crossing values, the logits and
    the step's arguments live, and a decode step's copies go straight between it and the device:
    the host copies nothing itself (no staging of an upload, no delivery of a download) and every
    asynchronous copy the driver was given reads or writes that memory. The logits stay the
    interpreter's."""
    pib = load_pib(pibs[name])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS[:5])
    with Session(pibs[name], threads=2, gpu="cuda") as session:
        gpu, fake = session.executor.gpu, fake_driver[0]
        assert gpu.host_mapping_error is None
        spans = session.executor.cpu.crossing_spans()
        assert all(fake.locked[start] == start + nbytes for start, nbytes in spans)
        logits = [_step(session, t) for t in TOKENS[:4]]
        staged = []
        for method in ("_stage_in", "_deliver"):
            monkeypatch.setattr(gpu, method, lambda *args, method=method: staged.append(method))
        logits.append(_step(session, TOKENS[4]))
        copies = [(call, host) for call, host, _ in fake.copies]
    assert staged == []
    assert copies and all(any(start <= host < start + n for start, n in spans) for _, host in copies), copies
    assert {"HtoD", "DtoH"} <= {call for call, _ in copies} if name == "split" else True
    assert rel_err(np.stack(logits), reference) <= 1e-3
    assert fake.locked == {}  # unregistered (and the staging buffer freed) at close


def test_a_value_that_an_in_place_kernel_writes_is_uploaded_from_a_snapshot(pibs):
    """A crossing value the CPU may write again while its upload waits in the stream (its manifest
    says ``shared``) is copied through the staging buffer, so the device gets the bytes it had at
    the launch; another value is copied from its own bytes, when the stream runs. (The stand-in
    device runs a queued copy only when it is waited for, as a real one may.)"""
    pib = PibFile(pibs["split"])
    fake = FakeCuda(pib)
    gpu = runtime.cuda.CudaGpu(pib, driver=runtime.cuda.Driver(fake))
    try:
        host = runtime.hostmem.huge_zeros(1 << 16)
        gpu.map_host([(host.ctypes.data, host.nbytes)], snapshot={"embed"})
        a, b = host[:256].view(np.float32), host[4096 : 4096 + 256].view(np.float32)
        a[:], b[:] = 1.0, 2.0
        gpu.launch([], [("embed", a), ("l0.attn.q", b)], [])  # two values in slots apart
        a[:], b[:] = 3.0, 4.0  # the CPU runs on before the copies did
        gpu.wait()
        out = np.empty(64, np.float32)
        gpu.download("embed", out)
        assert (out == 1.0).all()
        gpu.download("l0.attn.q", out)
        assert (out == 4.0).all()
    finally:
        gpu.close()


def test_copies_stay_staged_where_the_driver_will_not_page_lock(pibs, monkeypatch):
    """Where ``cuMemHostRegister`` fails, the executor says why and copies through its staging
    buffer as before, with the same logits."""
    class Refusing(FakeCuda):
        def _cuMemHostRegister_v2(self, *args: object) -> int:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY

    def make_gpu(pib: PibFile, mode: str):  # noqa: ANN202
        return runtime.cuda.CudaGpu(pib, driver=runtime.cuda.Driver(Refusing(pib)))

    monkeypatch.setattr(runtime.executor, "_make_gpu", make_gpu)
    pib = load_pib(pibs["split"])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS[:4])
    with Session(pibs["split"], threads=2, gpu="cuda") as session:
        logits = np.stack([_step(session, t) for t in TOKENS[:4]])
        assert "cuMemHostRegister" in session.executor.gpu.host_mapping_error
    assert rel_err(logits, reference) <= 1e-3


def test_a_prompt_queues_each_chunk_stage_token_after_token_and_waits_once(pibs, fake_driver):
    """A hybrid prompt's GPU part on a device that queues work: per chunk stage, every token's
    copies and kernels are queued back to back and the host waits once, at the stage's end (it
    waited per token and per copy before: ~17 us a copy on an H100); the second prompt captures
    each token's launch into a graph, and the third only replays them. The logits of every
    position are the interpreter's."""
    pib = load_pib(pibs["split"])
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    with Session(pibs["split"], threads=2, gpu="cuda") as session:
        ex, fake = session.executor, fake_driver[0]
        gpu_stages = sum(1 for st in ex.cpu.logits_chunks.stages if st.gpu)
        assert gpu_stages >= 2
        for prompt in range(3):
            calls = len(fake.calls)
            logits = ex.logits_of(TOKENS, 0)
            made = [call for _, call in fake.calls[calls:]]
            assert rel_err(logits, reference) <= 1e-3
            assert made.count("cuEventSynchronize") + made.count("cuStreamSynchronize") <= 2 * gpu_stages
            assert made.count("cuGraphLaunch") == (len(TOKENS) * gpu_stages if prompt else 0)
            if prompt == 2:
                assert "cuLaunchKernel" not in made and "cuMemcpyHtoDAsync_v2" not in made


def _greedy_runs(path, gpu: str, eos_at: int | None = None) -> list[tuple[list[int], np.ndarray]]:
    """12 greedy steps after a 4-token prompt, one by one and in the GPU's loop (``eos_at``: the
    step whose one-by-one token then ends the loop's run)."""
    runs: list[tuple[list[int], np.ndarray]] = []
    stops: set[int] = set()
    for loops in (False, True):
        with Session(path, threads=1, gpu=gpu) as session:
            ex = session.executor
            assert ex.gpu_loops
            ex.gpu_loops = loops
            session.feed(TOKENS[:4])
            tokens = ex.greedy_steps(ex.greedy(), session.pos, 12, stops)
            runs.append((tokens, ex.logits().copy()))
        if eos_at is not None and not loops:
            stops = {tokens[eos_at]}
    return runs


def test_a_whole_gpu_models_greedy_steps_run_in_a_loop_on_the_device(pibs, fake_driver):
    """Where the whole step is the GPU's, greedy steps run as a loop on the device: each step's
    graph is followed by the loop's kernel, which picks the next token and position there, so
    the host launches a graph a step and waits once for the whole run (it waited every step).
    The tokens and the last logits are those of the steps run one by one."""
    (plain, plain_logits), (looped, looped_logits) = _greedy_runs(pibs["tied"], "cuda")
    assert looped == plain and np.array_equal(looped_logits, plain_logits)
    by_step, in_loop = ([call for _, call in fake.calls] for fake in fake_driver)
    waits = [calls.count("cuEventSynchronize") + calls.count("cuStreamSynchronize") for calls in (by_step, in_loop)]
    assert waits[1] + 12 <= waits[0]


def test_the_greedy_loop_stops_at_eos_and_runs_on_the_emulated_gpu_too(pibs):
    """On the emulated GPU the loop runs the host build of the same kernel, with the tokens of the
    steps run one by one; with an end of sequence, the loop's run ends with it."""
    for eos_at in (None, 5):
        (plain, plain_logits), (looped, looped_logits) = _greedy_runs(pibs["tied"], "emulate", eos_at)
        if eos_at is None:
            assert looped == plain and np.array_equal(looped_logits, plain_logits)
        else:
            eos = plain[eos_at]
            assert looped == plain[: plain.index(eos) + 1]


def test_picc_gpu_loop_0_runs_greedy_steps_one_by_one(pibs, monkeypatch):
    """``PICC_GPU_LOOP=0`` (the GPU check's comparison) keeps a whole-GPU model's greedy steps one
    by one."""
    with Session(pibs["tied"], threads=1, gpu="emulate") as session:
        assert session.executor.gpu_loops
    monkeypatch.setenv("PICC_GPU_LOOP", "0")
    with Session(pibs["tied"], threads=1, gpu="emulate") as session:
        assert not session.executor.gpu_loops


def test_the_loop_is_compiled_where_the_whole_step_is_the_gpus(pibs):
    """The tied model's whole step is the GPU's: its file has the loop's kernel and buffer. The
    untied one embeds on the CPU: no loop, and the plan's notes say why."""
    tied, untied = PibFile(pibs["tied"]), PibFile(pibs["whole"])
    assert "@greedy_next" in tied.json("gpu/launches") and tied.plan().buffer("greedy") is not None
    assert "@greedy_next" not in untied.json("gpu/launches") and untied.plan().buffer("greedy") is None
    assert any("embedding is on the CPU" in note for note in untied.plan().notes)
    assert not any("embedding" in note for note in tied.plan().notes)
