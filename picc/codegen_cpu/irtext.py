"""A tiny writer of LLVM IR text: numbered temporaries, blocks, loops and ifs over allocas.

Kernels are written as Python functions that emit IR text through :class:`Fn`. Loop counters and
accumulators live in ``alloca`` slots (:meth:`Fn.var`); the optimizer's SROA / mem2reg turns them
into SSA registers and phi nodes, so the text stays short and readable while the machine code is
as if the phis were written by hand.

Floating-point operations are emitted *without* fast-math flags and with explicit ``llvm.fma``
calls: LLVM may then neither reassociate nor contract them, so a kernel computes the same bits
whatever the vector width of the target (an AVX2 build equals an AVX-512 build). The one
exception is ``nnan`` on the maximum that scales x's rounding (:mod:`.int16x`): a maximum of
values that are not NaN is the same whatever order it is taken in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

F32 = "float"
I32 = "i32"
I64 = "i64"
PTR = "ptr"


def vec(n: int, elem: str = F32) -> str:
    """The LLVM vector type ``<n x elem>``."""
    return f"<{n} x {elem}>"


def fconst(x: float) -> str:
    """A float constant as LLVM text (hex double form, exact for every float32 value)."""
    import struct

    bits = struct.unpack("<Q", struct.pack("<d", float(struct.unpack("<f", struct.pack("<f", x))[0])))[0]
    return f"0x{bits:016X}"


def vconst(n: int, value: str, elem: str = F32) -> str:
    """A splat vector constant ``<elem value, ...>``."""
    return "<" + ", ".join(f"{elem} {value}" for _ in range(n)) + ">"


class Var:
    """A mutable local: an ``alloca`` slot read with :meth:`get` and written with :meth:`set`."""

    def __init__(self, fn: Fn, ty: str, slot: str) -> None:
        self.fn, self.ty, self.slot = fn, ty, slot

    def get(self, hint: str = "v") -> str:
        return self.fn.v(f"load {self.ty}, ptr {self.slot}", hint)

    def set(self, value: str) -> None:
        self.fn.emit(f"store {self.ty} {value}, ptr {self.slot}")


class Fn:
    """One LLVM function being written; :meth:`text` returns its definition."""

    def __init__(self, name: str, params: list[tuple[str, str]], *, ret: str = "void",
                 linkage: str = "", attrs: str = "#0") -> None:
        self.name = name
        self.params = params
        self.ret = ret
        self.linkage = linkage
        self.attrs = attrs
        self._entry: list[str] = []  # allocas, hoisted to the entry block
        self._body: list[str] = []
        self._count = 0
        self._terminated = False

    # ---- values and lines

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"%{hint}.{self._count}"

    def emit(self, line: str) -> None:
        self._body.append("  " + line)

    def v(self, expr: str, hint: str = "t") -> str:
        """Emit ``%name = expr`` and return ``%name``."""
        name = self.fresh(hint)
        self.emit(f"{name} = {expr}")
        return name

    def var(self, ty: str, init: str | None = None, hint: str = "var") -> Var:
        slot = self.fresh(hint)
        self._entry.append(f"  {slot} = alloca {ty}, align 64")
        var = Var(self, ty, slot)
        if init is not None:
            var.set(init)
        return var

    def alloca_array(self, elem: str, count: str, hint: str = "buf") -> str:
        """A stack array of ``count`` (i64) elements, allocated where the call happens."""
        return self.v(f"alloca {elem}, i64 {count}, align 64", hint)

    # ---- control flow

    def label(self, hint: str) -> str:
        return self.fresh(hint)[1:]

    def start(self, label: str) -> None:
        self._body.append(f"{label}:")
        self._terminated = False

    def br(self, label: str) -> None:
        self.emit(f"br label %{label}")

    def cbr(self, cond: str, then: str, other: str) -> None:
        self.emit(f"br i1 {cond}, label %{then}, label %{other}")

    @contextmanager
    def loop(self, start: str, stop: str, step: str = "1", hint: str = "i") -> Iterator[str]:
        """``for (i = start; i < stop; i += step)`` over i64 values; yields ``i`` in the body."""
        counter = self.var(I64, start, hint)
        head, body, done = self.label(f"{hint}.head"), self.label(f"{hint}.body"), self.label(f"{hint}.done")
        self.br(head)
        self.start(head)
        i = counter.get(hint)
        self.cbr(self.v(f"icmp slt i64 {i}, {stop}", "more"), body, done)
        self.start(body)
        yield i
        counter.set(self.v(f"add i64 {i}, {step}", "next"))
        self.br(head)
        self.start(done)

    @contextmanager
    def if_(self, cond: str, hint: str = "if") -> Iterator[None]:
        then, done = self.label(f"{hint}.then"), self.label(f"{hint}.end")
        self.cbr(cond, then, done)
        self.start(then)
        yield
        self.br(done)
        self.start(done)

    # ---- common instructions

    def gep(self, base: str, byte_offset: str, hint: str = "p") -> str:
        """``base + byte_offset`` (i64 bytes)."""
        return self.v(f"getelementptr inbounds i8, ptr {base}, i64 {byte_offset}", hint)

    def at(self, base: str, elem_bytes: int, index: str, hint: str = "p") -> str:
        """Address of element ``index`` (i64) of an array of ``elem_bytes``-byte elements."""
        off = index if elem_bytes == 1 else self.v(f"mul i64 {index}, {elem_bytes}", "off")
        return self.gep(base, off, hint)

    def load(self, ty: str, ptr: str, align: int = 1, hint: str = "ld") -> str:
        return self.v(f"load {ty}, ptr {ptr}, align {align}", hint)

    def store(self, ty: str, value: str, ptr: str, align: int = 1) -> None:
        self.emit(f"store {ty} {value}, ptr {ptr}, align {align}")

    def prefetch(self, ptr: str, into: str) -> None:
        """Ask for the cache line at ``ptr`` (to read) into ``into``: "l1" (``prefetcht0``) or "l2"
        (``prefetcht1``). Measured on Zen 4 (docs/codegen_cpu.md, "Prefetching into L2"): rows
        gathered from scattered places read faster prefetched into L2 (more lines in flight),
        while the rows8 GEMVs' contiguous streams read faster into L1."""
        locality = {"l1": 3, "l2": 2}[into]
        self.emit(f"call void @llvm.prefetch.p0(ptr {ptr}, i32 0, i32 {locality}, i32 1)")

    def sext(self, value: str, hint: str = "w") -> str:
        return self.v(f"sext i32 {value} to i64", hint)

    def fma(self, ty: str, a: str, b: str, c: str, hint: str = "fma") -> str:
        return self.v(f"call {ty} @llvm.fma.{_suffix(ty)}({ty} {a}, {ty} {b}, {ty} {c})", hint)

    def splat(self, n: int, scalar: str, elem: str = F32, hint: str = "splat") -> str:
        one = self.v(f"insertelement {vec(1, elem)} poison, {elem} {scalar}, i64 0", hint)
        return self.v(f"shufflevector {vec(1, elem)} {one}, {vec(1, elem)} poison, "
                      f"<{n} x i32> zeroinitializer", hint)

    def hsum(self, n: int, value: str) -> str:
        """Sum of the lanes of a ``<n x float>``, halving in a fixed order (target independent)."""
        while n > 1:
            half = n // 2
            lo = self.v(f"shufflevector {vec(n)} {value}, {vec(n)} poison, <{half} x i32> "
                        f"<{', '.join(f'i32 {i}' for i in range(half))}>", "lo")
            hi = self.v(f"shufflevector {vec(n)} {value}, {vec(n)} poison, <{half} x i32> "
                        f"<{', '.join(f'i32 {i}' for i in range(half, n))}>", "hi")
            value = self.v(f"fadd {vec(half)} {lo}, {hi}", "hsum")
            n = half
        return self.v(f"extractelement <1 x float> {value}, i64 0", "sum")

    def min64(self, a: str, b: str) -> str:
        return self.v(f"select i1 {self.v(f'icmp slt i64 {a}, {b}', 'lt')}, i64 {a}, i64 {b}", "min")

    def max64(self, a: str, b: str) -> str:
        return self.v(f"select i1 {self.v(f'icmp sgt i64 {a}, {b}', 'gt')}, i64 {a}, i64 {b}", "max")

    def ret_void(self) -> None:
        self.emit("ret void")

    # ---- output

    def text(self) -> str:
        params = ", ".join(f"{ty} %{name}" for ty, name in self.params)
        linkage = f"{self.linkage} " if self.linkage else ""
        head = f"define {linkage}{self.ret} @{self.name}({params}) {self.attrs} {{"
        return "\n".join([head, "entry:", *self._entry, *self._body, "}", ""])


def _suffix(ty: str) -> str:
    """The intrinsic name suffix of a type: float -> f32, <32 x float> -> v32f32."""
    if ty == F32:
        return "f32"
    n, elem = ty.strip("<>").split(" x ")
    return f"v{n}{'f32' if elem == 'float' else elem}"


def chunk_bounds(fn: Fn, total: str, tid: str, nthreads: str, align: int = 1) -> tuple[str, str]:
    """Thread ``tid``'s share ``[lo, hi)`` of ``total`` (i64) items: ``total * t / n`` bounds.

    With ``align`` > 1 the bounds are rounded down to multiples of ``align`` (the last thread
    still ends at ``total``), so threads writing neighbouring floats never share a cache line.
    """
    def bound(t: str) -> str:
        b = fn.v(f"sdiv i64 {fn.v(f'mul i64 {total}, {t}', 'tn')}, {nthreads}", "bound")
        if align > 1:
            b = fn.v(f"and i64 {b}, {-align}", "aligned")
        return b

    t1 = fn.v(f"add i64 {tid}, 1", "t1")
    lo = bound(tid)
    hi_raw = bound(t1)
    last = fn.v(f"icmp eq i64 {t1}, {nthreads}", "last")
    hi = fn.v(f"select i1 {last}, i64 {total}, i64 {hi_raw}", "hi")
    return lo, hi
