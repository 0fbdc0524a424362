"""Helper functions every kernel module carries: the thread barrier and the scalar math.

All helpers are ``internal``: unused ones vanish in optimization, used ones are inlined. The math
is written out (no libm calls) so that results are the same on every machine and the object code
needs nothing from the C library but ``syscall`` (the barrier's futex, x86-64 Linux).

The barrier is a centralised counter barrier with a generation number, the counter-based form of
sense reversal: a thread reads the generation, then increments the arrival counter; the last to
arrive resets the counter and bumps the generation (release); the others spin on the generation
(acquire) with ``pause``, then yielding the core (``sched_yield``: when the late partner shares
this core with us, it runs at once instead of after our time slice), and after a few thousand
yields a waiter sleeps in ``futex(FUTEX_WAIT)`` on the generation word (counted in a sleepers
word, so the last thread only makes the ``FUTEX_WAKE`` system call when someone sleeps). The
state is three i32 on separate cache lines at the start of the ``sync`` buffer (``SYNC_BYTES``,
zero-initialised once); it is reusable forever.
"""

from __future__ import annotations

from picc.codegen_cpu.irtext import fconst

SYNC_BYTES = 192
"""Bytes of the zero-initialised barrier state every kernel and program takes as ``sync``."""

# ~6-10 us of pause (24 ns each on Zen 3 under KVM, ~40 on Zen 5) covers the usual imbalance
# between threads; then ~2 ms of sched_yield (0.6 us each when nothing else wants the core) before
# sleeping. Sleeping early is what hurts: a futex wake-up costs ~10 us, and a waiter that sleeps
# makes its partner wait for it at the next barrier, which then sleeps too (measured, 2-core KVM
# guest, threads pinned: 256 pauses then sleep cost 10 us per barrier; 256 pauses then yields
# 0.3 us, 1.3 us with another process busy on one of the cores).
_SPINS_BEFORE_YIELD = 256
_YIELDS_BEFORE_SLEEP = 4096
_SYS_SCHED_YIELD, _SYS_FUTEX, _FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 24, 202, 128, 129  # x86-64 Linux

_LN2_HI, _LN2_LO, _LOG2E = 0.693359375, -2.12194440e-4, 1.44269504088896341
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (the float approximation of Eigen / TensorFlow; a few
# ulp); |erf(x)| rounds to 1 in float32 beyond 4.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _horner(var: str, coeffs: tuple[float, ...], prefix: str) -> tuple[list[str], str]:
    lines = [f"  %{prefix}0 = fadd float 0.0, {fconst(coeffs[0])}"]
    for i, c in enumerate(coeffs[1:], 1):
        lines.append(f"  %{prefix}{i} = call float @llvm.fma.f32(float %{prefix}{i - 1}, float {var}, "
                     f"float {fconst(c)})")
    return lines, f"%{prefix}{len(coeffs) - 1}"


def _exp() -> str:
    poly, p = _horner("%r", _EXP_POLY, "p")
    return "\n".join([
        "; e^x to ~1 ulp: x = n ln2 + r, e^r by the Cephes polynomial, 2^n by building the exponent.",
        "define internal float @picc_exp(float %x) #1 {",
        "entry:",
        f"  %hi = fcmp ogt float %x, {fconst(88.0)}",
        f"  %lo = fcmp olt float %x, {fconst(-87.33)}",
        f"  %c1 = select i1 %hi, float {fconst(88.0)}, float %x",
        f"  %xc = select i1 %lo, float {fconst(-87.33)}, float %c1",
        f"  %t = fmul float %xc, {fconst(_LOG2E)}",
        "  %n = call float @llvm.roundeven.f32(float %t)",
        f"  %r0 = call float @llvm.fma.f32(float %n, float {fconst(-_LN2_HI)}, float %xc)",
        f"  %r = call float @llvm.fma.f32(float %n, float {fconst(-_LN2_LO)}, float %r0)",
        *poly,
        "  %r2 = fmul float %r, %r",
        f"  %q = call float @llvm.fma.f32(float {p}, float %r2, float %r)",
        "  %y = fadd float %q, 1.0",
        "  %ni = fptosi float %n to i32",
        "  %bits = shl i32 %ni, 23",
        "  %ebits = add i32 %bits, 1065353216",  # 127 << 23
        "  %scale = bitcast i32 %ebits to float",
        "  %e = fmul float %y, %scale",
        "  %e1 = select i1 %hi, float 0x7FF0000000000000, float %e",
        "  %e2 = select i1 %lo, float 0.0, float %e1",
        "  %nan = fcmp uno float %x, 0.0",
        "  %res = select i1 %nan, float %x, float %e2",
        "  ret float %res",
        "}",
    ])


def _erf() -> str:
    p_lines, p = _horner("%x2", _ERF_P, "a")
    q_lines, q = _horner("%x2", _ERF_Q, "b")
    return "\n".join([
        "define internal float @picc_erf(float %x) #1 {",
        "entry:",
        f"  %hi = fcmp ogt float %x, {fconst(4.0)}",
        f"  %c1 = select i1 %hi, float {fconst(4.0)}, float %x",
        f"  %lo = fcmp olt float %c1, {fconst(-4.0)}",
        f"  %xc = select i1 %lo, float {fconst(-4.0)}, float %c1",
        "  %x2 = fmul float %xc, %xc",
        *p_lines, *q_lines,
        f"  %px = fmul float {p}, %xc",
        f"  %r = fdiv float %px, {q}",
        "  ret float %r",
        "}",
    ])


_ACTIVATIONS = f"""
; tanh(z) = sign(z) (1 - e) / (1 + e) with e = exp(-2|z|): absolute error ~1e-7, enough for GELU,
; whose result is 0.5 x (1 + tanh(..)).
define internal float @picc_tanh(float %z) #1 {{
entry:
  %a = call float @llvm.fabs.f32(float %z)
  %m2a = fmul float %a, -2.0
  %e = call float @picc_exp(float %m2a)
  %num = fsub float 1.0, %e
  %den = fadd float 1.0, %e
  %t = fdiv float %num, %den
  %r = call float @llvm.copysign.f32(float %t, float %z)
  ret float %r
}}

; The activations of picc.interpreter.activation, in the same operation order.
define internal float @picc_act_relu(float %x) #1 {{
entry:
  %pos = fcmp ogt float %x, 0.0
  %r = select i1 %pos, float %x, float 0.0
  ret float %r
}}

define internal float @picc_act_silu(float %x) #1 {{
entry:
  %nx = fneg float %x
  %e = call float @picc_exp(float %nx)
  %d = fadd float 1.0, %e
  %r = fdiv float %x, %d
  ret float %r
}}

define internal float @picc_act_gelu(float %x) #1 {{
entry:
  %s = fdiv float %x, {fconst(2.0 ** 0.5)}
  %e = call float @picc_erf(float %s)
  %h = fmul float 0.5, %x
  %o = fadd float 1.0, %e
  %r = fmul float %h, %o
  ret float %r
}}

define internal float @picc_act_gelu_tanh(float %x) #1 {{
entry:
  %c = fmul float {fconst(0.044715)}, %x
  %c2 = fmul float %c, %x
  %c3 = fmul float %c2, %x
  %s = fadd float %x, %c3
  %in = fmul float {fconst((2.0 / 3.141592653589793) ** 0.5)}, %s
  %t = call float @picc_tanh(float %in)
  %h = fmul float 0.5, %x
  %o = fadd float 1.0, %t
  %r = fmul float %h, %o
  ret float %r
}}
"""

def _barrier() -> str:
    # Over 80 lines: one LLVM IR function written out as text, block by block (spin, futex
    # wait, wake), which reads best whole.
    return f"""
; Wait until all %n threads have called this with the same %sync (see picc/codegen_cpu/prelude.py).
define internal void @picc_barrier(ptr %sync, i32 %n) #2 {{
entry:
  %single = icmp sle i32 %n, 1
  br i1 %single, label %done, label %arrive
arrive:
  %genp = getelementptr inbounds i8, ptr %sync, i64 64
  %sleepp = getelementptr inbounds i8, ptr %sync, i64 128
  %gen = load atomic i32, ptr %genp seq_cst, align 4
  %old = atomicrmw add ptr %sync, i32 1 acq_rel, align 4
  %n1 = sub i32 %n, 1
  %last = icmp eq i32 %old, %n1
  br i1 %last, label %release, label %spin
release:
  store atomic i32 0, ptr %sync monotonic, align 4
  %next = add i32 %gen, 1
  store atomic i32 %next, ptr %genp seq_cst, align 4
  %sleepers = load atomic i32, ptr %sleepp seq_cst, align 4
  %anyone = icmp ne i32 %sleepers, 0
  br i1 %anyone, label %wake, label %done
wake:
  %woken = call i64 (i64, ...) @syscall(i64 {_SYS_FUTEX}, ptr %genp, i32 {_FUTEX_WAKE_PRIVATE}, i32 2147483647)
  br label %done
spin:
  %spins = phi i32 [ 0, %arrive ], [ %spins1, %pause ], [ %spins1, %yield ]
  %cur = load atomic i32, ptr %genp acquire, align 4
  %moved = icmp ne i32 %cur, %gen
  br i1 %moved, label %done, label %wait
wait:
  %spins1 = add i32 %spins, 1
  %eager = icmp ult i32 %spins, {_SPINS_BEFORE_YIELD}
  br i1 %eager, label %pause, label %polite
pause:
  call void @llvm.x86.sse2.pause()
  br label %spin
polite:
  %patient = icmp ult i32 %spins, {_SPINS_BEFORE_YIELD + _YIELDS_BEFORE_SLEEP}
  br i1 %patient, label %yield, label %sleep
yield:
  %y = call i64 (i64, ...) @syscall(i64 {_SYS_SCHED_YIELD})
  br label %spin
sleep:
  %s0 = atomicrmw add ptr %sleepp, i32 1 seq_cst, align 4
  br label %recheck
recheck:
  %cur2 = load atomic i32, ptr %genp seq_cst, align 4
  %moved2 = icmp ne i32 %cur2, %gen
  br i1 %moved2, label %awake, label %futex
futex:
  ; returns at once (EAGAIN) if the generation moved after the check: no lost wake-up
  %r = call i64 (i64, ...) @syscall(i64 {_SYS_FUTEX}, ptr %genp, i32 {_FUTEX_WAIT_PRIVATE}, i32 %gen, ptr null)
  br label %recheck
awake:
  %s1 = atomicrmw sub ptr %sleepp, i32 1 seq_cst, align 4
  br label %done
done:
  ret void
}}

; A thread team without Python in the loop (runtime.threads.ThreadTeam): %state is TEAM_BYTES
; zeroed bytes, the barrier's state first, then the job (a step function's address), its table
; and a closing flag. Threads 1.. run @picc_team_worker(state, tid, n) until the team closes;
; thread 0 stores a job and the table, then meets them in @picc_team_barrier before and after
; running the job itself. The barrier orders the stores before the loads.
define void @picc_team_barrier(ptr %state, i32 %n) {{
entry:
  call void @picc_barrier(ptr %state, i32 %n)
  ret void
}}

define void @picc_team_worker(ptr %state, i32 %tid, i32 %n) {{
entry:
  %jobp = getelementptr inbounds i8, ptr %state, i64 {SYNC_BYTES}
  %tablep = getelementptr inbounds i8, ptr %state, i64 {SYNC_BYTES + 8}
  %closep = getelementptr inbounds i8, ptr %state, i64 {SYNC_BYTES + 16}
  br label %loop
loop:
  call void @picc_barrier(ptr %state, i32 %n)
  %closing = load atomic i32, ptr %closep acquire, align 4
  %stop = icmp ne i32 %closing, 0
  br i1 %stop, label %exit, label %run
run:
  %job = load ptr, ptr %jobp, align 8
  %table = load ptr, ptr %tablep, align 8
  call void %job(ptr %table, i32 %tid, i32 %n)
  call void @picc_barrier(ptr %state, i32 %n)
  br label %loop
exit:
  ret void
}}
"""

_DECLARATIONS = """
declare float @llvm.fma.f32(float, float, float)
declare <32 x float> @llvm.fma.v32f32(<32 x float>, <32 x float>, <32 x float>)
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare <16 x float> @llvm.x86.avx512.permvar.sf.512(<16 x float>, <16 x i32>)
declare float @llvm.roundeven.f32(float)
declare float @llvm.fabs.f32(float)
declare <32 x float> @llvm.fabs.v32f32(<32 x float>)
declare i32 @llvm.cttz.i32(i32, i1)
declare float @llvm.copysign.f32(float, float)
declare float @llvm.sqrt.f32(float)
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.minnum.f32(float, float)
declare <16 x float> @llvm.maxnum.v16f32(<16 x float>, <16 x float>)
declare float @llvm.vector.reduce.fmax.v16f32(<16 x float>)
declare <16 x float> @llvm.fabs.v16f32(<16 x float>)
declare <16 x float> @llvm.roundeven.v16f32(<16 x float>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8>, <32 x i8>)
declare <16 x i8> @llvm.x86.ssse3.pshuf.b.128(<16 x i8>, <16 x i8>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.x86.sse2.pause()
declare i64 @syscall(i64, ...)
declare i64 @llvm.readcyclecounter()

; The clock of profiled steps (Program.profiled), for the runtime to measure its rate.
define i64 @picc_cycles() #2 {
entry:
  %t = call i64 @llvm.readcyclecounter()
  ret i64 %t
}
"""


def prelude() -> str:
    """IR text of the declarations and helpers every kernel module starts with."""
    return "\n".join([_DECLARATIONS, _exp(), "", _erf(), _ACTIVATIONS, _barrier()])


def attributes(simd: str) -> str:
    """Function attribute groups: #0 kernels and steps, #1 inlined math, #2 the barrier and the clock,
    #3 kernels that use AVX-512 VNNI (``kernel.kernel_fn``: the ``by_level`` ones on ``avx512-vnni``).

    Kernels are never inlined into a step: it would gain nothing measurable and makes the
    optimiser's time grow with the square of the step's length (15 s for 300 calls).

    ``min-legal-vector-width`` / ``prefer-vector-width`` let the backend use full 512-bit
    registers for the ``<32 x float>`` vectors on AVX-512 (some CPUs default to 256).
    """
    width = 512 if simd == "avx512" else 256
    vector = f'"min-legal-vector-width"="{width}" "prefer-vector-width"="{width}"'
    return "\n".join([
        f"attributes #0 = {{ nounwind noinline {vector} }}",
        f"attributes #1 = {{ nounwind alwaysinline {vector} }}",
        "attributes #2 = { nounwind noinline }",
        f'attributes #3 = {{ nounwind noinline {vector} "target-features"="+avx512vnni" }}',
    ])
