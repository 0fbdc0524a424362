"""Programs: a sequence of kernel calls compiled into ONE function that every thread runs.

A decode step is dozens of kernels; calling each from Python (and handing it to the threads) would
cost more than the kernels. A :class:`Program` lists the calls with their arguments and becomes
``void name(ptr bufs, i32 tid, i32 nthreads)``; all threads call it once per step and meet at a
barrier (on ``bufs[sync]``) after each call, so each kernel sees the previous one's results.

Arguments name memory by index into the ``bufs`` table (an array of pointers the caller fills
once, e.g. weights, activations, scratch, KV cache), so the same compiled step serves every
token; values that change per token (the position) are read at run time from an i32 buffer with
:class:`Param`. Example::

    prog = Program("decode_step", sync=0)
    prog.call(rms_norm(), Buf(X), Buf(NORM_W), Null(), Buf(H), 1, 576, 1e-5)
    prog.call(attention(), ..., Param(PARAMS, 0), ...)   # pos = params[0]

:meth:`Program.profiled` is the same step timed call by call: each thread adds the cycles
(``llvm.readcyclecounter``: the x86 time-stamp counter) of every call and of the barrier after
it to its row of an i64 buffer (see :func:`profile_slots`); ``picc bench --profile`` reads it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from picc.codegen_cpu.irtext import fconst
from picc.codegen_cpu.kernel import KIND_TYPES, Kernel
from picc.errors import PiccError


@dataclass(frozen=True, slots=True)
class Buf:
    """The pointer ``bufs[index] + offset`` (bytes); in a call repeated per token (see
    :meth:`Program.call`), ``bufs[index] + offset + s * stride`` for token s."""

    index: int
    offset: int = 0
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Param:
    """An i32 read when the step runs: ``((int32 *) bufs[buffer])[slot]``; in a call repeated per
    row s, ``[slot + s * stride]`` (a value of each row's own: a batch's positions)."""

    buffer: int
    slot: int
    stride: int = 0


@dataclass(frozen=True, slots=True)
class Null:
    """A null pointer (an absent bias, an unused list)."""


Arg = Buf | Param | Null | int | float


@dataclass(frozen=True, slots=True)
class Call:
    kernel: Kernel
    args: tuple[Arg, ...]
    barrier_after: bool
    repeat: Param | None = None  # run once per token s < repeat, with Bufs advanced by s * stride
    label: str = ""  # what the call computes (the IR value), for profiles
    rows_apart: bool = False  # repeated, and no row writes memory another row touches: no barrier between rows


@dataclass(frozen=True, slots=True)
class Access:
    """What a call reads and writes (names of values or of memory), and whether it may run
    without a barrier before it (a kernel of one phase that touches nothing but its operands and
    result)."""

    reads: frozenset[str]
    writes: frozenset[str]
    barrier_free: bool


def place_barriers(calls: list[Call], access: list[Access]) -> list[Call]:
    """``calls`` with a barrier after a call only where the next one needs it: when the next
    reads or writes a value written since the last barrier, writes one read since, or is not
    barrier-free (a kernel with phases of its own starts with every thread there)."""
    out: list[Call] = []
    reads: set[str] = set()
    writes: set[str] = set()
    for call, acc in zip(calls, access, strict=True):
        if out:
            need = not acc.barrier_free or bool(acc.reads & writes or acc.writes & (reads | writes))
            out[-1] = replace(out[-1], barrier_after=need)
            if need:
                reads, writes = set(), set()
        reads |= acc.reads
        writes |= acc.writes
        out.append(replace(call, barrier_after=True))
    return out


def profile_slots(calls: int) -> int:
    """i64 slots per thread of a profiled program of ``calls`` calls: call n's cycles in slot 2n,
    those of the barrier after it (0 without one) in 2n + 1, and the number of runs last."""
    return 2 * calls + 1


class Program:
    """A step function under construction; ``sync`` is the index of the barrier-state buffer."""

    def __init__(self, name: str, *, sync: int = 0, profile: int | None = None) -> None:
        self.name = name
        self.sync = sync
        self.profile = profile  # the bufs index of the profile counters, when profiled
        self.calls: list[Call] = []

    def profiled(self, buffer: int, name: str | None = None) -> Program:
        """This program with a clock around every call and barrier: thread t adds their cycles to
        row t (:func:`profile_slots` i64 each) of ``bufs[buffer]``, which holds a row per thread."""
        copy = Program(name or f"{self.name}_profile", sync=self.sync, profile=buffer)
        copy.calls = list(self.calls)
        return copy

    def call(self, kernel: Kernel, *args: Arg, barrier_after: bool = True, repeat: Param | None = None,
             label: str = "", rows_apart: bool = False) -> None:
        """Append a call of ``kernel`` with one argument per :attr:`Kernel.params`.

        ``barrier_after=False`` lets the next call start without waiting; only safe when it reads
        nothing this call writes. ``repeat``: call the kernel once per token s of a prefill chunk
        of ``repeat`` tokens (a kernel that sees one token at a time), each ``Buf`` argument
        advanced by ``s * stride`` bytes, with a barrier after every iteration (the iterations
        share the kernel's scratch, or a token reads what the one before wrote) -- unless
        ``rows_apart``: no iteration writes memory another one reads or writes (a batch's rows,
        each in its own memory, the weights read-only), so the threads go from row to row without
        waiting, and ``barrier_after`` applies after the last; a :attr:`Kernel.token_split`
        kernel's rows are then shared out whole, each called by one thread as a team of one.
        """
        if len(args) != len(kernel.params):
            names = ", ".join(n for n, _ in kernel.params)
            raise PiccError(f"codegen_cpu: {kernel.symbol} takes {len(kernel.params)} arguments ({names}), "
                            f"got {len(args)}")
        wanted = {"ptr": "a Buf or Null", "i32": "an int or Param", "f32": "a float"}
        for (name, kind), arg in zip(kernel.params, args, strict=True):
            ok = {"ptr": isinstance(arg, Buf | Null),
                  "i32": isinstance(arg, Param) or (isinstance(arg, int) and not isinstance(arg, bool)),
                  "f32": isinstance(arg, float | int) and not isinstance(arg, bool)}[kind]
            if not ok:
                raise PiccError(f"codegen_cpu: {kernel.symbol} argument {name} must be {wanted[kind]}, got {arg!r}")
        self.calls.append(Call(kernel, tuple(args), barrier_after, repeat, label, rows_apart and repeat is not None))

    @property
    def kernels(self) -> list[Kernel]:
        return [c.kernel for c in self.calls]

    def emit(self) -> str:
        """IR text of the step function (the kernels themselves are emitted by the module).

        Over 80 lines: one pass over the calls that writes each call's argument loads, its
        barrier and its profile stamps in the order they appear in the generated function."""
        lines = [f"define void @{self.name}(ptr %bufs, i32 %tid, i32 %nthreads) #0 {{", "entry:",
                 "  %tid.64 = sext i32 %tid to i64", "  %nthreads.64 = sext i32 %nthreads to i64"]
        count = 0

        def tmp(expr: str) -> str:
            nonlocal count
            count += 1
            lines.append(f"  %v{count} = {expr}")
            return f"%v{count}"

        def buf(index: int) -> str:
            slot = tmp(f"getelementptr inbounds ptr, ptr %bufs, i64 {index}")
            return tmp(f"load ptr, ptr {slot}, align 8")

        def row_index(first: int, stride: int, s: str | None) -> str:
            """``first + s * stride``: the entry of row ``s`` (``first`` outside a repeated call)."""
            return str(first) if s is None or not stride else tmp(f"add i64 {tmp(f'mul i64 {s}, {stride}')}, {first}")

        def param(p: Param, s: str | None = None) -> str:
            slot = tmp(f"getelementptr inbounds i32, ptr {buf(p.buffer)}, i64 {row_index(p.slot, p.stride, s)}")
            return tmp(f"load i32, ptr {slot}, align 4")

        sync = buf(self.sync)
        clock = counters = None
        if self.profile is not None:
            row = tmp(f"mul i64 {tmp('sext i32 %tid to i64')}, {profile_slots(len(self.calls))}")
            counters = tmp(f"getelementptr inbounds i64, ptr {buf(self.profile)}, i64 {row}")
            clock = tmp("call i64 @llvm.readcyclecounter()")

        def add_to(slot: int, value: str) -> None:
            """counters[slot] += value."""
            at = tmp(f"getelementptr inbounds i64, ptr {counters}, i64 {slot}")
            total = tmp(f"add i64 {tmp(f'load i64, ptr {at}, align 8')}, {value}")
            lines.append(f"  store i64 {total}, ptr {at}, align 8")

        def lap(slot: int) -> None:
            """Add the cycles since the last lap to counters[slot]."""
            nonlocal clock
            if clock is not None:
                now = tmp("call i64 @llvm.readcyclecounter()")
                add_to(slot, tmp(f"sub i64 {now}, {clock}"))
                clock = now

        for n, call in enumerate(self.calls):
            lines.append(f"  ; {n}: {call.kernel.symbol}" + (" per token" if call.repeat else ""))
            s = None
            # Rows apart, a token-split kernel's rows go to the threads whole (row s to thread s mod
            # nthreads, called as a team of one): the kernel would give each row to one thread anyway.
            whole = call.rows_apart and call.kernel.token_split
            first, step = ("%tid.64", "%nthreads.64") if whole else ("0", "1")
            if call.repeat is not None:
                tokens = tmp(f"sext i32 {param(call.repeat)} to i64")
                before = f"%b{n}.pre"
                lines += [f"  br label {before}", f"b{n}.pre:", f"  br label %b{n}.head", f"b{n}.head:"]
                s = f"%b{n}.s"
                lines += [f"  {s} = phi i64 [{first}, {before}], [%b{n}.next, %b{n}.body]",
                          f"  %b{n}.more = icmp slt i64 {s}, {tokens}",
                          f"  br i1 %b{n}.more, label %b{n}.body, label %b{n}.exit", f"b{n}.body:"]
            values = []
            for (_, kind), arg in zip(call.kernel.params, call.args, strict=True):
                ty = KIND_TYPES[kind]
                if isinstance(arg, Null):
                    values.append(f"{ty} null")
                elif isinstance(arg, Buf):
                    base = buf(arg.index)
                    offset = str(arg.offset)
                    if s is not None and arg.stride:
                        offset = tmp(f"add i64 {tmp(f'mul i64 {s}, {arg.stride}')}, {arg.offset}")
                    ptr = tmp(f"getelementptr inbounds i8, ptr {base}, i64 {offset}") if offset != "0" else base
                    values.append(f"{ty} {ptr}")
                elif isinstance(arg, Param):
                    values.append(f"{ty} {param(arg, s)}")
                elif kind == "f32":
                    values.append(f"{ty} {fconst(float(arg))}")
                else:
                    values.append(f"{ty} {int(arg)}")
            values += ["i32 0", "i32 1", f"ptr {sync}"] if whole else ["i32 %tid", "i32 %nthreads", f"ptr {sync}"]
            lines.append(f"  call void @{call.kernel.symbol}({', '.join(values)})")
            if s is not None and not call.rows_apart:
                lines += [f"  call void @picc_barrier(ptr {sync}, i32 %nthreads)",
                          f"  %b{n}.next = add i64 {s}, 1", f"  br label %b{n}.head", f"b{n}.exit:"]
                lap(2 * n)  # the calls and their barriers, together
            else:
                if s is not None:
                    lines += [f"  %b{n}.next = add i64 {s}, {step}", f"  br label %b{n}.head", f"b{n}.exit:"]
                lap(2 * n)
                if call.barrier_after and n + 1 < len(self.calls):
                    lines.append(f"  call void @picc_barrier(ptr {sync}, i32 %nthreads)")
                    lap(2 * n + 1)
        if clock is not None:
            add_to(2 * len(self.calls), "1")
        lines += ["  ret void", "}", ""]
        return "\n".join(lines)


def buffer_table(buffers: Sequence[np.ndarray | int | None]) -> ctypes.Array:
    """The ``bufs`` array of a step: numpy arrays (their data pointer), raw addresses or None.

    The table keeps the arrays alive (an array made in the call's argument list would otherwise
    be freed while the step still writes to it); memory behind a raw address is the caller's.
    """
    table = (ctypes.c_void_p * len(buffers))()
    for i, b in enumerate(buffers):
        table[i] = None if b is None else b if isinstance(b, int) else b.ctypes.data
    table._arrays = [b for b in buffers if isinstance(b, np.ndarray)]  # type: ignore[attr-defined]
    return table


@dataclass(frozen=True, slots=True)
class GreedyLoop:
    """``name(bufs, tid, nthreads)``: greedy decode steps, one after another, without returning.

    Every thread calls it once; it runs up to ``params[steps]`` steps of the function whose
    address is the table entry ``bufs[step]`` (the decode step, or its profiled twin), each on the
    token in ``params[token]`` at ``params[pos]``. After each step, thread 0 stores the step's
    greedy token (``params[greedy]``) in ``bufs[out][i]`` and feeds it to the next step (token,
    pos + 1, ``params[done]`` = steps run); it stops early after a step whose greedy token is
    one of the ``stops`` stop tokens from ``params[stops]`` on (-1: an unused slot). Two barriers
    a step: after it (its argmax is written) and after thread 0's update (every thread reads the
    new token before the next step starts).

    One call instead of one per token: a decode loop in Python costs ~13 us a token on a 2-core
    KVM guest (the hand-off to the thread team, ctypes, bookkeeping), 5% of a relu-demo token.
    """

    name: str
    step: int
    params: int
    out: int
    sync: int
    slots: tuple[tuple[str, int], ...]  # the params slots: pos, token, greedy, steps, done, stops
    stops: int  # how many stop-token slots follow params[stops]

    @property
    def kernels(self) -> list[Kernel]:
        return []

    def emit(self) -> str:
        slot = dict(self.slots)

        def entry(index: int, name: str) -> list[str]:
            return [f"  %{name}.at = getelementptr inbounds ptr, ptr %bufs, i64 {index}",
                    f"  %{name} = load ptr, ptr %{name}.at, align 8"]

        lines = [f"define void @{self.name}(ptr %bufs, i32 %tid, i32 %nthreads) #0 {{", "entry:",
                 *entry(self.sync, "sync"), *entry(self.params, "params"), *entry(self.out, "out"),
                 *entry(self.step, "step")]
        lines += [f"  %p.{name} = getelementptr inbounds i32, ptr %params, i64 {slot[name]}"
                  for name in ("pos", "token", "greedy", "steps", "done")]
        lines += ["  %steps = load i32, ptr %p.steps, align 4", "  %lead = icmp eq i32 %tid, 0"]
        for k in range(self.stops):
            lines += [f"  %p.stop{k} = getelementptr inbounds i32, ptr %params, i64 {slot['stops'] + k}",
                      f"  %stop{k} = load i32, ptr %p.stop{k}, align 4"]
        lines += ["  br label %head",
                  "head:",
                  "  %i = phi i32 [0, %entry], [%next, %fed]",
                  "  %more = icmp slt i32 %i, %steps",
                  "  br i1 %more, label %body, label %exit",
                  "body:",
                  "  call void %step(ptr %bufs, i32 %tid, i32 %nthreads)",
                  "  call void @picc_barrier(ptr %sync, i32 %nthreads)",
                  "  %next = add i32 %i, 1",
                  "  br i1 %lead, label %feed, label %fed",
                  "feed:",
                  "  %g = load i32, ptr %p.greedy, align 4",
                  "  %ix = sext i32 %i to i64",
                  "  %outi = getelementptr inbounds i32, ptr %out, i64 %ix",
                  "  store i32 %g, ptr %outi, align 4",
                  "  store i32 %g, ptr %p.token, align 4",
                  "  %pos = load i32, ptr %p.pos, align 4",
                  "  %pos1 = add i32 %pos, 1",
                  "  store i32 %pos1, ptr %p.pos, align 4",
                  "  store i32 %next, ptr %p.done, align 4",
                  "  br label %fed",
                  "fed:",
                  "  call void @picc_barrier(ptr %sync, i32 %nthreads)",
                  "  %t = load i32, ptr %p.token, align 4"]
        hit = "false"
        for k in range(self.stops):
            lines += [f"  %is{k} = icmp eq i32 %t, %stop{k}", f"  %hit{k} = or i1 {hit}, %is{k}"]
            hit = f"%hit{k}"
        lines += [f"  br i1 {hit}, label %exit, label %head",
                  "exit:",
                  "  ret void", "}", ""]
        return "\n".join(lines)
