"""CPU programs and builds: a step program against its kernels one by one, barriers, profiling, the
AVX2 build's bits, object code and its cache, VNNI where the host has it, the native thread team."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from cpu_kernels import DTYPES, PLANES_MODES, FfnCase, gap_threshold, planes_of, rel_err, run, weights, width

from picc.codegen_cpu import (
    SYNC_BYTES,
    Buf,
    CpuModule,
    Null,
    Param,
    Program,
    ThreadTeam,
    aligned_zeros,
    buffer_table,
    compile_kernels,
    rowplanes,
)
from picc.codegen_cpu.irtext import Fn
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.kernels_attention import attention
from picc.codegen_cpu.kernels_dense import gemm, gemv
from picc.codegen_cpu.kernels_ffn import ffn_scratch_bytes, sparse_ffn
from picc.codegen_cpu.kernels_misc import add, argmax, ffn_activation, rms_norm, rope
from picc.codegen_cpu.program import profile_slots
from picc.codegen_cpu.rowops import emit_axpys, emit_dots, emit_x_sums
from picc.errors import PiccError

# The AVX2 build: one kernel of each kind, every weight format.
AVX2_KERNELS = ([gemv(d) for d in DTYPES] + [gemv("mxfp4"), gemv("mxfp4", "i16")] + [sparse_ffn("predictor", "swiglu", d, d, d) for d in DTYPES]
                + [sparse_ffn(m, "swiglu", d, d, d, il, x_format="i16", gathered="dotplanes") for m, il in PLANES_MODES
                   for d in ("q4_0", "q4_1")]
                + [sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"), gemm("q4_1"), attention("f16"), rms_norm(),
                   ffn_activation("geglu")])
# The host build: the AVX2 build's kernels and the decode-like program's.
KERNELS = AVX2_KERNELS + [rope("llama"), attention(), argmax()]


@pytest.fixture(scope="module")
def host() -> CpuModule:
    return compile_kernels(KERNELS, simd="host")


@pytest.fixture(scope="module")
def avx2() -> CpuModule:
    return compile_kernels(AVX2_KERNELS, simd="avx2")


def _decode_like_program(buffers: dict[str, int]) -> list[tuple[Kernel, tuple]]:
    """A norm -> projections -> rope -> attention -> residual -> sparse FFN -> argmax chain."""
    b = {k: Buf(v) for k, v in buffers.items()}
    hid, heads, kv, hd, n = 64, 4, 2, 16, 96
    return [
        (rms_norm(), (b["x"], b["norm"], Null(), b["h"], 1, hid, 1e-5)),
        (gemv("q4_0"), (b["wq"], b["h"], Null(), b["q"], heads * hd, hid, 0)),
        (gemv("q8_0"), (b["wk"], b["h"], Null(), b["k"], kv * hd, hid, 0)),
        (gemv("f16"), (b["wv"], b["h"], Null(), b["v"], kv * hd, hid, 0)),
        (rope("llama"), (b["q"], b["cos"], b["sin"], 1, Param(buffers["params"], 0), heads, hd, hd)),
        (rope("llama"), (b["k"], b["cos"], b["sin"], 1, Param(buffers["params"], 0), kv, hd, hd)),
        (attention(), (b["q"], b["k"], b["v"], b["kc"], b["vc"], b["att"], 1, Param(buffers["params"], 0), heads, kv,
                       hd, hd, 0.25, 0, 8)),
        (gemv("q4_1"), (b["wo"], b["att"], Null(), b["x"], hid, heads * hd, 1)),
        (sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"),
         (b["x"], b["up"], b["gate"], b["down"], Null(), Null(), Null(), b["x2"], Null(), Null(), b["scratch"], n, hid,
          0.05, Null(), 0)),
        (sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0"),  # x2 += the FFN of x2: a residual add
         (b["x2"], b["up"], b["gate"], b["down"], Null(), Null(), Null(), b["x2"], Null(), Null(), b["scratch"], n,
          hid, 0.05, Null(), 1)),
        (argmax(), (b["x2"], b["out"], hid)),
    ]


def test_program_equals_kernels_one_by_one(host, teams):
    names = ["sync", "params", "x", "norm", "h", "wq", "wk", "wv", "q", "k", "v", "cos", "sin", "kc", "vc", "att", "wo", "up",
             "gate", "down", "x2", "scratch", "out"]
    index = {name: i for i, name in enumerate(names)}
    calls = _decode_like_program(index)
    prog = Program("test_step", sync=index["sync"])
    for kernel, args in calls:
        prog.call(kernel, *args)
    module = compile_kernels([], [prog])

    def fresh() -> dict[str, np.ndarray]:
        r = np.random.default_rng(21)
        angles = np.arange(3, dtype=np.float32)[:, None] / 10000 ** (np.arange(0, 16, 2) / 16)  # 3 positions
        data = {"x": r.normal(size=64).astype(np.float32), "norm": np.ones(64, np.float32),
                "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
        for name, shape, dt in (("wq", (64, 64), "q4_0"), ("wk", (32, 64), "q8_0"), ("wv", (32, 64), "f16"),
                                ("wo", (64, 64), "q4_1"), ("up", (96, 64), "q4_0"), ("gate", (96, 64), "q4_0"),
                                ("down", (96, 64), "q4_0")):
            data[name] = weights(r, shape, dt, 0.2)[0]
        data["down"] = rowplanes.to_rowplanes(data["down"], "q4_0", (96, 64))
        for name, size in (("h", 64), ("q", 64), ("k", 32), ("v", 32), ("att", 64), ("x2", 64)):
            data[name] = np.zeros(size, np.float32)
        data["kc"], data["vc"] = np.zeros((8, 32), np.float32), np.zeros((8, 32), np.float32)
        data["scratch"] = aligned_zeros(ffn_scratch_bytes(96, 64, 3))
        data["out"], data["params"], data["sync"] = np.zeros(1, np.int32), np.zeros(4, np.int32), aligned_zeros(SYNC_BYTES)
        return data

    stepped, single = fresh(), fresh()
    table = buffer_table([stepped[n] for n in names])
    step = module.function("test_step", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
    for pos in range(3):  # the same compiled step at three positions (pos read from params)
        stepped["params"][0] = pos
        teams[3].run_each(lambda tid: step(ctypes.addressof(table), tid, 3))
        for kernel, args in calls:
            values = [single[names[a.index]] if isinstance(a, Buf) else None if isinstance(a, Null)
                      else pos if isinstance(a, Param) else a for a in args]
            run(host, teams[3], kernel, *values)
        for name in ("x", "q", "kc", "att", "x2", "out"):
            np.testing.assert_array_equal(stepped[name], single[name], err_msg=f"{name} at pos {pos}")


def test_barriers_order_a_chain_of_dependent_kernels(teams):
    # y1 = W y0, y0 = W y1, ... : each GEMV reads all of the previous one's rows, written by every
    # thread; without the barriers a thread would read stale rows. Each row's sum does not depend
    # on the thread count, so the 3-thread result must equal the 1-thread one bit for bit.
    rng = np.random.default_rng(22)
    rows = 64
    w = (rng.normal(size=(rows, rows)) / 8).astype(np.float32)
    prog = Program("chain", sync=0)
    for i in range(40):
        src, dst = (2, 3) if i % 2 == 0 else (3, 2)
        prog.call(gemv("f32"), Buf(1), Buf(src), Null(), Buf(dst), rows, rows, 0)
    module = compile_kernels([], [prog])
    step = module.function("chain", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
    results = []
    for n in (1, 3):
        bufs = [aligned_zeros(SYNC_BYTES), w, np.ones(rows, np.float32), np.zeros(rows, np.float32)]
        table = buffer_table(bufs)
        for _ in range(5):
            bufs[2][:], bufs[3][:] = 1, 0
            teams[n].run_each(lambda tid, t=table, n=n: step(ctypes.addressof(t), tid, n))
            results.append(bufs[2].copy())
    ref = np.ones(rows)
    for _ in range(20):
        ref = w @ (w @ ref)
    for r in results:
        np.testing.assert_array_equal(r, results[0])
    assert rel_err(results[0], ref) <= 1e-4  # 40 chained products of float32 rounding


def test_a_profiled_program_counts_each_calls_cycles_and_computes_the_same(teams):
    # A GEMV of 512 x 512, one of 8 x 8 (4096 times fewer products), and the big one again on the
    # first one's result (the last call: no barrier after it). The profiled twin must leave the
    # same results and count, per thread, the runs, more cycles in each big GEMV than in the small
    # one, time at the barriers after the first two calls and none after the last.
    rng = np.random.default_rng(27)
    big, small = ((rng.normal(size=(n, n)) / n).astype(np.float32) for n in (512, 8))
    prog = Program("timed", sync=0)
    prog.call(gemv("f32"), Buf(1), Buf(3), Null(), Buf(4), 512, 512, 0, label="big")
    prog.call(gemv("f32"), Buf(2), Buf(3), Null(), Buf(5), 8, 8, 0, label="small")
    prog.call(gemv("f32"), Buf(1), Buf(4), Null(), Buf(6), 512, 512, 0, label="big again")
    profiled = prog.profiled(7)
    assert profiled.name == "timed_profile" and [c.label for c in profiled.calls] == ["big", "small", "big again"]
    module = compile_kernels([], [prog, profiled])
    slots = profile_slots(3)
    runs, threads = 9, 2
    outputs = []
    counters = np.zeros((threads, slots), np.int64)
    for name in ("timed", "timed_profile"):
        step = module.function(name, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32])
        bufs = [aligned_zeros(SYNC_BYTES), big, small, np.linspace(-1, 1, 512, dtype=np.float32),
                np.zeros(512, np.float32), np.zeros(8, np.float32), np.zeros(512, np.float32), counters]
        table = buffer_table(bufs)
        for _ in range(runs):
            teams[threads].run_each(lambda tid, t=table, s=step: s(ctypes.addressof(t), tid, threads))
        outputs.append([bufs[4].copy(), bufs[5].copy(), bufs[6].copy()])
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_array_equal(a, b)
    kernel, wait = counters[:, 0:6:2], counters[:, 1:6:2]
    assert (counters[:, slots - 1] == runs).all()
    assert (kernel[:, 0] > kernel[:, 1]).all() and (kernel[:, 2] > kernel[:, 1]).all()
    assert (wait[:, :2] > 0).all() and (wait[:, 2] == 0).all()


def test_avx2_build_computes_the_same_bits(host, avx2, teams):
    rng = np.random.default_rng(23)
    for dtype in DTYPES:
        raw, _ = weights(rng, (37, width(dtype)), dtype)
        x = rng.normal(size=width(dtype)).astype(np.float32)
        ys = []
        for module in (host, avx2):
            ys.append(np.zeros(37, np.float32))
            run(module, teams[2], gemv(dtype), raw, x, None, ys[-1], 37, width(dtype), 0)
        np.testing.assert_array_equal(ys[0], ys[1], err_msg=dtype)
        # 224: a rowplanes down row of a four-, a two- and a one-block unit
        case = FfnCase("swiglu", (dtype, dtype, dtype), hidden=224 if dtype in rowplanes.DTYPES else None, seed=24)
        active = rng.random(case.n) < 0.4
        kernel = sparse_ffn("predictor", "swiglu", dtype, dtype, dtype)
        np.testing.assert_array_equal(case.run(host, teams[3], kernel, active=active)[0],
                                      case.run(avx2, teams[3], kernel, active=active)[0], err_msg=dtype)
    # mxfp4 rows (a table lookup a nibble, a power-of-two scale), with float and int16 x
    raw, _ = weights(rng, (37, 96), "mxfp4")
    x = rng.normal(size=96).astype(np.float32)
    for kernel in (gemv("mxfp4"), gemv("mxfp4", "i16")):
        ys = [np.zeros(37, np.float32), np.zeros(37, np.float32)]
        for module, y in zip((host, avx2), ys, strict=True):
            run(module, teams[2], kernel, raw, x, None, y, 37, 96, 0)
        np.testing.assert_array_equal(ys[0], ys[1], err_msg=kernel.symbol)
    # Rounded x: gathered rows from the dotplanes layout, four blocks a piece in one vector or two
    # (224: a four-, a two- and a one-block piece), the same float operations lane by lane.
    for dtype in ("q4_0", "q4_1"):
        case = FfnCase("swiglu", (dtype,) * 3, hidden=224, seed=26)
        for mode, il in PLANES_MODES:
            kernel = sparse_ffn(mode, "swiglu", dtype, dtype, dtype, il, x_format="i16", gathered="dotplanes")
            thr = 0.0 if mode == "predictor" else gap_threshold(case.act_gate(), 0.4)
            outs = [case.run(m, teams[2], kernel, active=active[: case.n], threshold=thr, interleaved=il,
                             planes=planes_of(mode)) for m in (host, avx2)]
            assert outs[0][1] == outs[1][1] > 0
            np.testing.assert_array_equal(outs[0][0], outs[1][0], err_msg=f"{dtype} {mode} {il}")
    case = FfnCase("swiglu", ("q4_0",) * 3, seed=25)
    kernel = sparse_ffn("gate-first", "swiglu", "q4_0", "q4_0", "q4_0")
    np.testing.assert_array_equal(case.run(host, teams[2], kernel, threshold=0.1)[0],
                                  case.run(avx2, teams[2], kernel, threshold=0.1)[0])
    # 11 positions, scored four at a time, then one at a time; head size 20, a 16-element slice
    # and a tail; value heads of 20, and of another width than the keys' (v_head_dim): 36, two
    # 16-element slices and a tail.
    q = rng.normal(size=(11, 80)).astype(np.float32)
    for vd in (20, 36):
        k, v = rng.normal(size=(11, 40)).astype(np.float32), rng.normal(size=(11, 2 * vd)).astype(np.float32)
        outs = []
        for module in (host, avx2):
            outs.append(np.zeros((11, 4 * vd), np.float32))
            run(module, teams[2], attention("f16"), q, k, v, np.zeros((12, 40), np.float16),
                np.zeros((12, 2 * vd), np.float16), outs[-1], 11, 0, 4, 2, 20, vd, 0.25, 0, 12)
        np.testing.assert_array_equal(outs[0], outs[1])
    assert "zmm" not in avx2.emit_assembly()  # really no AVX-512 in the AVX2 build


def test_object_code_loads_back(host, teams):
    obj = host.emit_object()
    assert obj[:4] == b"\x7fELF"
    assert "define void @picc_gemv_q4_0" in host.ir  # the optimised IR, stored beside the object
    loaded = CpuModule.from_object(obj)
    rng = np.random.default_rng(26)
    raw, _ = weights(rng, (37, 96), "q4_0")
    x = rng.normal(size=96).astype(np.float32)
    ys = []
    for module in (host, loaded):
        ys.append(np.zeros(37, np.float32))
        run(module, teams[2], gemv("q4_0"), raw, x, None, ys[-1], 37, 96, 0)
    np.testing.assert_array_equal(ys[0], ys[1])


def test_compiled_objects_are_cached_by_their_ir(tmp_path, monkeypatch, teams):
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir = build_ir([gemv("f32")], (), "avx2")
    first = compiler.compiled_object(ir, "avx2")
    assert first[1][:4] == b"\x7fELF" and "define void @picc_gemv_f32" in first[0]
    # A hit runs no LLVM: the same optimised IR and object come back from the cache, and run.
    real = compiler.CpuModule
    monkeypatch.setattr(compiler, "CpuModule", lambda *_, **__: pytest.fail("compiled again"))
    assert compiler.compiled_object(ir, "avx2") == first
    with monkeypatch.context() as m:  # a cache it cannot write to still serves its entries
        m.setattr(compiler.Path, "touch", lambda *_, **__: (_ for _ in ()).throw(PermissionError("read-only")))
        assert compiler.compiled_object(ir, "avx2") == first
    rng = np.random.default_rng(27)
    w, x = rng.normal(size=(5, 64)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    y = np.zeros(5, np.float32)
    run(real.from_object(first[1], "avx2"), teams[1], gemv("f32"), w, x, None, y, 5, 64, 0)
    np.testing.assert_allclose(y, w @ x, rtol=1e-5)
    # Another IR, or another SIMD level, is compiled; so is an entry whose object was damaged
    # (cut short: it would otherwise go into a .pib); the cache keeps the most recent entries.
    for other in ((ir + "\n", "avx2"), (ir, "avx512")):
        with pytest.raises(pytest.fail.Exception, match="compiled again"):
            compiler.compiled_object(*other)
    (obj_path,) = (tmp_path / "cpu-objects").glob("*.o")
    obj_path.write_bytes(first[1][:-100])
    with pytest.raises(pytest.fail.Exception, match="compiled again"):
        compiler.compiled_object(ir, "avx2")
    monkeypatch.setattr(compiler, "CpuModule", real)
    assert compiler.compiled_object(ir, "avx2") == first  # and the entry is whole again
    monkeypatch.setattr(compiler, "OBJECT_CACHE_ENTRIES", 1)
    compiler.compiled_object(build_ir([gemv("f16")], (), "avx2"), "avx2")
    assert [len(list((tmp_path / "cpu-objects").glob(f"*{s}"))) for s in (".ll", ".o", ".sha256")] == [1, 1, 1]


def test_the_fallback_ir_is_optimised_without_code_generation(tmp_path, monkeypatch):
    # A VNNI compile's AVX-512 fallback is carried as IR: the same optimised IR as a whole
    # compile's, no object code made for it (half of LLVM's time), and its cache entry apart from
    # the object's (a later compile that wants the object still gets one).
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir = build_ir([gemv("q4_1", x_format="i16")], (), "avx512")
    real = compiler.CpuModule

    class NoCodegen(real):
        def emit_object(self) -> bytes:
            raise AssertionError("generated object code")

    monkeypatch.setattr(compiler, "CpuModule", NoCodegen)
    optimised, obj = compiler.compiled_object(ir, "avx512", object_code=False)
    assert obj == b"" and "define void @picc_gemv_q4_1_xi16" in optimised
    monkeypatch.setattr(compiler, "CpuModule", lambda *_, **__: pytest.fail("compiled again"))
    assert compiler.compiled_object(ir, "avx512", object_code=False) == (optimised, b"")  # from the cache
    monkeypatch.setattr(compiler, "CpuModule", real)
    whole = compiler.compiled_object(ir, "avx512")
    assert whole[0] == optimised and whole[1][:4] == b"\x7fELF"


def test_bad_inputs_are_one_line_errors(host):
    with pytest.raises(PiccError, match="weight dtype 'q5_k' is not supported"):
        gemv("q5_k")
    with pytest.raises(PiccError, match="gate-first' needs a gated form"):
        sparse_ffn("gate-first", "relu", "f16", None, "f16")
    with pytest.raises(PiccError, match="picc_add takes 4 arguments"):
        Program("p").call(add(), Buf(0))
    with pytest.raises(PiccError, match="argument n must be an int or Param"):
        Program("p").call(add(), Buf(0), Buf(1), Buf(2), 1.5)
    with pytest.raises(PiccError, match="no function 'nope'"):
        host.address("nope")
    with pytest.raises(PiccError, match="simd 'neon' is not supported"):
        compile_kernels([add()], simd="neon")


def test_4bit_rows_need_the_sums_their_constant_parts_moved_to():
    """A kernel that dots or AXPYs q4_0 / q4_1 rows without x's block sums (or without the
    per-block constants array) would silently drop the rows' -8 / m terms: refused at IR time.
    So are AXPYs of block-format rows in GGUF's rows: the kernels read them as rowplanes."""
    fn = Fn("f", [("ptr", "row"), ("ptr", "x"), ("ptr", "y")])
    for dtype in ("q4_0", "q4_1"):
        with pytest.raises(PiccError, match=rf"dot products of \['{dtype}'\] rows need x's sums"):
            emit_dots(fn, [(dtype, "%row")], "%x", "64", "avx2")
        with pytest.raises(PiccError, match=f"{dtype} rows need per-block constants"):
            rowplanes.emit_axpys(fn, [(dtype, "%row", "1.0")], "%y", "64", ["%c"], None)
        with pytest.raises(PiccError, match="AXPYs of block-format rows read the rowplanes layout"):
            emit_axpys(fn, [(dtype, "%row", "1.0")], "%y", "64", "avx2")
    sums = emit_x_sums(fn, "%x", "64", {"q4_0"})
    assert sums is not None and sums.offsets and sums.folded is None
    with pytest.raises(PiccError, match="need x's sums"):  # q4_1 needs the folded sums too
        emit_dots(fn, [("q4_1", "%row")], "%x", "64", "avx2", xsums=sums)
    assert emit_x_sums(fn, "%x", "64", {"f16", "q8_0"}) is None


def test_native_thread_team_runs_steps_in_generated_code(monkeypatch):
    """A team whose workers loop in generated code (``picc_team_worker``): each step runs once on
    every thread with its tid, consecutive steps see each other's results (the barriers order
    them), Python jobs are refused, and closing ends the workers. Inside ``pinned()`` the caller
    keeps thread 0's core across steps (pinned once, not per step) and gets its affinity back."""
    from runtime import threads as runtime_threads
    from runtime.threads import ThreadTeam as RuntimeTeam

    assert runtime_threads._SYNC_BYTES == SYNC_BYTES  # the runtime imports nothing of picc: kept in step

    step_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
    prog = Program("count_step", sync=0)
    prog.call(add(), Buf(1), Buf(2), Buf(1), 64)  # acc += one, rows split across the threads
    module = compile_kernels([], [prog])
    native = (step_t(module.address("picc_team_worker")),
              ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(module.address("picc_team_barrier")))
    step = step_t(module.address("count_step"))
    acc, one = np.zeros(64, np.float32), np.ones(64, np.float32)
    table = buffer_table([aligned_zeros(SYNC_BYTES), acc, one])
    team = RuntimeTeam(2, native=native)
    try:
        for _ in range(50):
            team.run_step(step, ctypes.addressof(table))
        np.testing.assert_array_equal(acc, np.full(64, 50, np.float32))
        own = os.sched_getaffinity(0)
        pins: list[set[int]] = []
        set_affinity = os.sched_setaffinity
        monkeypatch.setattr(runtime_threads.os, "sched_setaffinity",
                            lambda pid, cores: pins.append(set(cores)) or set_affinity(pid, cores))
        with team.pinned():
            with team.pinned():  # nested: free
                for _ in range(10):
                    team.run_step(step, ctypes.addressof(table))
            inside = os.sched_getaffinity(0)
        np.testing.assert_array_equal(acc, np.full(64, 60, np.float32))
        assert os.sched_getaffinity(0) == own
        if team._cores is None:  # fewer cores than threads: nothing is pinned
            assert pins == [] and inside == own
        else:
            assert pins == [{team._cores[0]}, own] and inside == {team._cores[0]}
        with pytest.raises(RuntimeError, match="step functions only"):
            team.run_each(lambda tid: None)
    finally:
        team.close()
    assert not any(w.is_alive() for w in team._workers)


def _kernel_asm(kernels: list, simd: str) -> dict[str, str]:
    import llvmlite.binding as llvm

    from picc.codegen_cpu import build_ir, compiler

    optimised = llvm.parse_assembly(compiler.CpuModule(build_ir(kernels, (), simd), simd).ir)
    text = compiler.target_machine(simd).emit_assembly(optimised)
    return {k.symbol: text[text.index(f"{k.symbol}:") : text.index(".Lfunc_end", text.index(f"{k.symbol}:"))]
            for k in kernels}


def test_on_avx512_vnni_the_one_row_int16_gemv_does_not_use_vnni():
    """The ``avx512-vnni`` level gives VNNI to the kernels written for it (``by_level``: the batched
    rows8 ones, ``vpdpbusd``) and to no other: compiled with VNNI, LLVM turned the one-row int16
    kernels' ``vpmaddwd`` + add into ``vpdpwssd``, and the one-row step decoded slower for it.
    Their IR and their instructions are plain AVX-512's (compiled here whatever this host has)."""
    from picc.codegen_cpu import build_ir
    from picc.codegen_cpu.kernels_batch import gemv_rows

    kernel, batched = gemv("q4_1", x_format="i16"), gemv_rows("q4_1", "i16", rows8=True)
    assert build_ir([kernel], (), "avx512-vnni") == build_ir([kernel], (), "avx512")  # the same kernel IR
    asm = {simd: _kernel_asm([kernel, batched], simd) for simd in ("avx512", "avx512-vnni")}
    for simd in asm:
        assert "vpmaddwd" in asm[simd][kernel.symbol] and "vpdpwssd" not in asm[simd][kernel.symbol], simd
    assert "vpdpbusd" in asm["avx512-vnni"][batched.symbol] and "vpdpbusd" not in asm["avx512"][batched.symbol]


def test_on_avx512_vnni_the_int_x_sparse_ffn_sums_eight_rows_with_vpdpbusd():
    """The sparse FFN with rounded x is written for the level too: its eight-row dot products
    (the gathered rows, a dense rows8 part) sum with ``vpdpbusd`` there, the same integers
    (tests/test_codegen_cpu_batch.py checks the bits across levels). In-process A/B, 4096 x
    11008 q4_1, int16 x, three alternations, Zen 4: 1.02-1.04x at 10-50% active on one and two
    threads, though LLVM also turns some of its one-row ``vpmaddwd`` into ``vpdpwssd``."""
    from picc.codegen_cpu import build_ir
    from runtime.cpu import host_has

    kernel = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True, x_format="i16")
    floats = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True)
    assert kernel.by_level and not floats.by_level
    assert build_ir([floats], (), "avx512-vnni") == build_ir([floats], (), "avx512")
    asm = {simd: _kernel_asm([kernel], simd)[kernel.symbol] for simd in ("avx512", "avx512-vnni")}
    assert "vpdpbusd" in asm["avx512-vnni"] and "vpdpbusd" not in asm["avx512"]
    if not host_has("avx512-vnni"):
        pytest.skip("this host cannot run avx512-vnni code (compiled only)")
    case, active = FfnCase("swiglu", ("q4_1",) * 3, n=136, hidden=96, seed=34), np.random.default_rng(35).random(136) < 0.4
    with ThreadTeam(2) as team:  # 136 neurons: octets and a pair of leftovers on each thread
        outs = [case.run(compile_kernels([kernel], simd=simd), team, kernel, active=active, interleaved=True)
                for simd in ("avx512", "avx512-vnni")]
    assert outs[0][1] == outs[1][1] == active.sum()
    assert np.array_equal(outs[0][0].view(np.uint32), outs[1][0].view(np.uint32))
    # Rows one at a time from the dotplanes layout: vpdpbusd there too, the same bits (224: a
    # four-, a two- and a one-block piece a row).
    planes = sparse_ffn("predictor", "swiglu", "q4_1", "q4_1", "q4_1", True, x_format="i16", gathered="dotplanes")
    asm = {simd: _kernel_asm([planes], simd)[planes.symbol] for simd in ("avx512", "avx512-vnni")}
    assert "vpdpbusd" in asm["avx512-vnni"] and "vpdpbusd" not in asm["avx512"]
    case = FfnCase("swiglu", ("q4_1",) * 3, n=136, hidden=224, seed=36)
    with ThreadTeam(2) as team:
        outs = [case.run(compile_kernels([planes], simd=simd), team, planes, active=active, interleaved=True,
                         planes=("up", "gate")) for simd in ("avx512", "avx512-vnni")]
    assert outs[0][1] == outs[1][1] == active.sum()
    assert np.array_equal(outs[0][0].view(np.uint32), outs[1][0].view(np.uint32))


def test_vnni_object_code_is_recompiled_where_the_host_lacks_vnni(monkeypatch, tmp_path):
    """A .pib's object code for ``avx512-vnni`` is loaded as it is only on a CPU with VNNI;
    elsewhere the runtime compiles the file's IR for the CPU it runs on (``MachineCode.rejit``)."""
    import runtime.cpu as rc
    from picc.codegen_cpu import build_ir, compiler

    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    ir, obj = compiler.compiled_object(build_ir([gemv("q4_1", x_format="i16")], (), "avx512-vnni"), "avx512-vnni")
    have = rc.host_features()
    assert rc.MachineCode(obj, ir, "avx512-vnni").rejit == (not {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= have)
    monkeypatch.setattr(rc, "host_features", lambda: have - {"avx512vnni"})
    assert rc.MachineCode(obj, ir, "avx512-vnni").rejit


def test_a_buffer_table_keeps_its_arrays_alive():
    # A step writes through the table's pointers: an array made in buffer_table's argument list
    # (a barrier's state, say) must live as long as the table, or the step writes freed memory
    # (it corrupted the heap of picc.codegen_cpu.rates' measurement).
    import gc
    import weakref

    from picc.codegen_cpu import buffer_table

    array = np.zeros(64, np.uint8)
    alive = weakref.ref(array)
    table = buffer_table([array, None, 16])
    del array
    gc.collect()
    assert alive() is not None and table[0] == alive().ctypes.data
    del table
    gc.collect()
    assert alive() is None
