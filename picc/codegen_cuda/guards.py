"""Guards on scheduled GPU kernels: loops wrapped in ``if (row is live)`` after scheduling.

A kernel's ``guards`` (``kernel.Kernel``) say which rows of a reduction may be skipped; a schedule
annotates the loop that computes such a row with ``GUARD`` (``picc_guard``) and ``apply_guards``
wraps that loop in the guard, so a skipped row loads nothing. A schedule may also guard blocks it
made itself (``TileGuard``: the down AXPY's trips of rows) and drop the per-row condition inside a
block whose dead rows add exactly zero (``eager``). This TVM exposes no Python IR mutator, so the
few statement kinds a scheduled kernel holds are rebuilt by hand here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.ir.expr import Expr as PrimExpr
from tvm.sym import Analyzer

from picc.codegen_cuda.kernel import Guard, Kernel
from picc.errors import PiccError

T = TypeVar("T")

GUARD = "picc_guard"


@dataclass(frozen=True, slots=True)
class TileGuard:
    """A guard the schedule adds to a block it made: the block's iterator names, in order, and
    ``guard(buffers_by_name, *values)`` over their values (``apply_guards``)."""

    axes: list[str]
    guard: Guard


def apply_guards(func: tirx.PrimFunc, kernel: Kernel, tiles: dict[str, TileGuard] | None = None,
                 eager: tuple[str, ...] = ()) -> tirx.PrimFunc:
    """Wrap every loop annotated ``picc_guard`` in ``if (guard(...))``, the guard evaluated at the
    loop's first trip.

    A name in ``kernel.guards`` is a block of the definition: the guard's index is read from the
    bindings of the first block under the loop whose iterators include that block's spatial axes
    (``v_<axis>``). A name in ``tiles`` is a block the schedule made (``TileGuard``: its axes and
    guard). Either way the index is in terms of the loop variables in scope at the guarded loop,
    with the loop's own variable at its first value. (This TVM exposes no Python IR mutator, so the
    few statement kinds a scheduled kernel holds are rebuilt by hand.)

    A block named in ``eager`` (``acc = acc + if_then_else(row live, term, 0)``, inside a guarded
    trip) drops the per-row condition: the schedule's caller vouches that a dead row's term is
    zero, so its loads may run unconditionally beside the live rows' (in flight together).
    """
    buffers = {b.name: b for b in func.params}  # in this TVM, params are the buffers
    guards = {name: TileGuard(spatial_axes(kernel.func, name), guard) for name, guard in kernel.guards.items()}
    guards.update(tiles or {})

    def rewrite(node: tirx.Stmt) -> tirx.Stmt:
        if isinstance(node, tirx.For):
            body = rewrite(node.body)
            if GUARD not in node.annotations:
                return tirx.For(node.loop_var, node.min, node.extent, node.kind, body, node.thread_binding,
                                node.annotations)
            name = str(node.annotations[GUARD])
            guard = guards[name]
            index = _binding_of(body, guard.axes)
            if index is None:
                raise PiccError(f"kernel {kernel.name}: no block under the guarded loop of {name} "
                                f"binds {guard.axes}")
            at_first = Analyzer()  # the loop nest's first trip: every loop variable at its first value
            for loop in [node, *_loops_under(body)]:
                at_first.bind(loop.loop_var, loop.min)
            first = [at_first.simplify(i) for i in index]
            annotations = {k: v for k, v in node.annotations.items() if k != GUARD}
            loop = tirx.For(node.loop_var, node.min, node.extent, node.kind, body, node.thread_binding, annotations)
            return tirx.IfThenElse(guard.guard(buffers, *first), loop, None)
        if isinstance(node, tirx.SeqStmt):
            return tirx.SeqStmt([rewrite(s) for s in node.seq])
        if isinstance(node, s_tir.SBlockRealize):
            b = node.block
            body = _unconditional(b.body) if b.name_hint in eager else rewrite(b.body)
            block = s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, body, b.init,
                                 b.alloc_buffers, b.match_buffers, b.annotations)
            return s_tir.SBlockRealize(node.iter_values, node.predicate, block)
        if isinstance(node, tirx.IfThenElse):
            return tirx.IfThenElse(node.condition, rewrite(node.then_case),
                                   rewrite(node.else_case) if node.else_case is not None else None)
        return node

    return func.with_body(rewrite(func.body)) if guards or eager else func


def _unconditional(store: tirx.Stmt) -> tirx.Stmt:
    """``acc = acc + if_then_else(c, term, 0)`` as ``acc = acc + term`` (see ``apply_guards``)."""
    value = store.value if isinstance(store, tirx.BufferStore) else None
    term = value.b if isinstance(value, tirx.Add) else None
    if not (isinstance(term, Call) and term.op.name.endswith("if_then_else")):
        raise PiccError(f"an eager block must add one if_then_else to its accumulator, got {store}")
    return tirx.BufferStore(store.buffer, tirx.Add(value.a, term.args[1]), store.indices)


def _loops_under(node: tirx.Stmt) -> list[tirx.For]:
    """Every ``for`` loop inside ``node``, blocks included."""
    if isinstance(node, s_tir.SBlockRealize):
        return _loops_under(node.block.body)
    own = [node] if isinstance(node, tirx.For) else []
    return own + [loop for child in _children(node) for loop in _loops_under(child)]


def _binding_of(node: tirx.Stmt, names: list[str]) -> list[PrimExpr] | None:
    """The values bound to iterators ``names`` by the first block under ``node`` that has them all."""

    def binding(realize: s_tir.SBlockRealize) -> list[PrimExpr] | None:
        bound = {iv.var.name: v for iv, v in zip(realize.block.iter_vars, realize.iter_values, strict=True)}
        return [bound[n] for n in names] if all(n in bound for n in names) else None

    return _first_block(node, binding)


def _first_block(node: tirx.Stmt, pick: Callable[[s_tir.SBlockRealize], T | None]) -> T | None:
    """``pick`` of the first block under ``node`` (depth first, outer blocks before the blocks
    inside them) for which it is not None."""
    if isinstance(node, s_tir.SBlockRealize):
        found = pick(node)
        return found if found is not None else _first_block(node.block.body, pick)
    for child in _children(node):
        if (found := _first_block(child, pick)) is not None:
            return found
    return None


def _children(node: tirx.Stmt) -> list[tirx.Stmt]:
    """The statements directly inside a loop, a sequence or an ``if`` (none for other kinds)."""
    if isinstance(node, tirx.For):
        return [node.body]
    if isinstance(node, tirx.SeqStmt):
        return list(node.seq)
    if isinstance(node, tirx.IfThenElse):
        return [node.then_case] + ([node.else_case] if node.else_case is not None else [])
    return []


def spatial_axes(func: tirx.PrimFunc, name: str) -> list[str]:
    """The names of block ``name``'s spatial iterators in ``func``."""
    block = _find_block(func.body, name)
    if block is None:
        raise PiccError(f"kernel has no block named {name!r} to guard")
    return [iv.var.name for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]


def _find_block(node: tirx.Stmt, name: str) -> s_tir.SBlock | None:
    return _first_block(node, lambda realize: realize.block if realize.block.name_hint == name else None)
