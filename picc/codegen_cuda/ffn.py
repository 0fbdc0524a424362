"""The fused sparse FFN kernels: gather-GEMV of the active rows, activation, AXPY of down rows.

``sparse_ffn`` (predictor mode) reads an index list of active neurons::

    ug[r, j] = W_ug[idx[r], j, :] . x          r < count, j = 0 (up), 1 (gate, GLU forms)
    h(r)     = act(ug[r, 0])                    plain forms
             = act(ug[r, 1]) * ug[r, 0]         GLU forms (swiglu, reglu, geglu, ...)
             = relu(ug[r, 1]) * relu(ug[r, 0])  dReLU
    y[k]     = sum_{r < count} h(r) * down_t[idx[r], k]

The sum over rows runs in ``S`` slices (``runtime.gpu_layout.axpy_slices``): slice ``s`` takes rows
``s, s + S, s + 2S, ...`` into ``y_part[s, :]`` and a second step adds the slices up, so the AXPY
spreads over every SM whatever the hidden size, and the active rows (the first ``count``) fall
evenly on all slices.

``up`` and ``gate`` are packed into one ``W_ug`` [n_ff, J, hidden] (row i of up, then row i of
gate) so one warp reduces one (neuron, projection) pair with a single weight stream;
``down_t`` is the neuron-major (transposed) down matrix [n_ff, hidden]. ``idx`` has a static
length ``n_pad`` (n_ff rounded up to the row tile) and ``count`` [1] says how many entries are
real; entries past ``count`` are never dereferenced, and ``ug`` rows past ``count`` are zero.
``y`` is this part's partial sum: the down bias, if any, is added once after the CPU and GPU
parts are merged. With ``residual``, the kernel also does the decode step's residual add: the
slices' sum takes ``r`` as its last term, so ``y = (sum of slices) + r``, the add's bits.

``gate_first_ffn`` (exact, GLU forms): the gate is computed for every neuron; neuron r is active
when ``|act(gate_r . x)| > threshold`` and only active neurons read up and down.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.ir.expr import Expr as PrimExpr

from picc.codegen_cuda.dense import row_dot
from picc.codegen_cuda.formats import WeightFormat
from picc.codegen_cuda.kernel import Kernel, activation, check_positive, f32, make_kernel
from picc.errors import PiccError
from picc.ir.ops import FFN_FORMS, FfnForm
from runtime import gpu_layout

FORMS = FFN_FORMS  # how each FFN form combines its projections: the IR's own table

H_STAGE, LIVE_STAGE = "h", "live"
"""The stages of each neuron's ``h``, which the down AXPY scales its row by, and (gate-first) of
whether it is active: blocks of their own in the definition, so that a host build computes them
once per neuron (the CPU schedule; inlined per element, SiLU's exp was ~70% of a SwiGLU FFN's time
on the emulated GPU), while the GPU schedules inline them back into the AXPY
(:func:`picc.codegen_cuda.schedules.schedule`: the CUDA of before)."""

ROW_TILE = gpu_layout.ROW_TILE
"""Rows (warps) per thread block of the gather-GEMV; index lists are padded to a multiple of it."""


def padded(n: int, tile: int = ROW_TILE) -> int:
    """``n`` rounded up to a multiple of ``tile``: the static length of an index list."""
    return -(-n // tile) * tile


def _form(form: str) -> FfnForm:
    if form not in FORMS:
        raise PiccError(f"FFN form {form!r} has no GPU kernel; expected one of {', '.join(FORMS)}")
    return FORMS[form]


def _combine(form: str, up: PrimExpr, gate: PrimExpr | None) -> PrimExpr:
    spec = _form(form)
    if not spec.gated:
        return activation(spec.act, up)
    assert gate is not None
    return activation(spec.act, gate) * (activation(spec.act, up) if spec.act_on_up else up)


def sparse_ffn(name: str, hidden: int, n_ff: int, form: str, fmt: str, *, n_pad: int | None = None,
               bias: bool = False, residual: bool = False) -> Kernel:
    """The fused FFN over the neurons listed in ``idx[:count]`` (see the module docstring).

    Parameters in order: ``x`` [hidden], ``idx`` [n_pad] i32, ``count`` [1] i32, the buffers of
    ``W_ug`` [n_ff, J, hidden] and ``down`` [n_ff, hidden] in ``fmt``, ``b_ug`` [n_ff, J] when
    ``bias``, ``r`` [hidden] with ``residual``, scratch ``ug`` [n_pad, J] and ``y_part`` [S, hidden]
    (S = ``gpu_layout.axpy_slices(n_pad, hidden)``), output ``y`` [hidden].
    """
    check_positive(hidden=hidden, n_ff=n_ff)
    n_pad = padded(n_ff) if n_pad is None else n_pad
    if n_pad < n_ff or n_pad % ROW_TILE:
        raise PiccError(f"{name}: n_pad={n_pad} must be >= n_ff={n_ff} and a multiple of {ROW_TILE}")
    return _gather_ffn(name, hidden, n_ff, form, fmt, bias, n_pad, residual)


def dense_ffn(name: str, hidden: int, n_ff: int, form: str, fmt: str, *, bias: bool = False,
              residual: bool = False) -> Kernel:
    """The FFN over every neuron: ``sparse_ffn`` without an index list (a dense layer on the GPU).

    Parameters: ``x``, the buffers of ``W_ug`` and ``down``, ``b_ug`` when ``bias``, ``r`` with
    ``residual``, scratch ``ug`` [n_ff, J] and ``y_part`` [S, hidden], output ``y``.
    """
    check_positive(hidden=hidden, n_ff=n_ff)
    return _gather_ffn(name, hidden, n_ff, form, fmt, bias, None, residual)


def _gather_ffn(name: str, hidden: int, n_ff: int, form: str, fmt: str, bias: bool, n_pad: int | None,
                residual: bool) -> Kernel:
    """``sparse_ffn`` (``n_pad``: the index list's length) or ``dense_ffn`` (``n_pad`` None)."""
    gated = _form(form).gated
    indexed = n_pad is not None
    rows = n_pad if n_pad is not None else n_ff
    wf = WeightFormat(fmt)
    j_count = 2 if gated else 1
    x = te.placeholder((hidden,), "float32", name="x")
    args = [(x, "in")]
    if indexed:
        idx = te.placeholder((rows,), "int32", name="idx")
        count = te.placeholder((1,), "int32", name="count")
        args += [(idx, "in"), (count, "in")]

        def neuron(r: PrimExpr) -> PrimExpr:
            # Clamped (a no-op on any list ``compact`` writes): TVM cannot bound a row it reads
            # from memory, and would guard each staged 16-byte load of it with its own branch.
            return tirx.min(tirx.max(idx[r], 0), n_ff - 1)

        def live(r: PrimExpr) -> PrimExpr:
            return r < count[0]
    else:

        def neuron(r: PrimExpr) -> PrimExpr:
            return r

        live = None
    w_ug = wf.placeholders("W_ug", (n_ff, j_count), hidden)
    w_down = wf.placeholders("down", (n_ff,), hidden)
    args += [*[(t, "in") for t in w_ug], *[(t, "in") for t in w_down]]

    ug = row_dot("ug", wf, w_ug, lambda r, j, k: x[k], (rows, j_count), hidden,
                 row_of=lambda r, j: (neuron(r), j), when=(lambda r, j: live(r)) if live else None)
    if bias:
        b_ug = te.placeholder((n_ff, j_count), "float32", name="b_ug")
        args.append((b_ug, "in"))

        def proj(r: PrimExpr, j: int) -> PrimExpr:
            return ug[r, j] + b_ug[neuron(r), j]
    else:

        def proj(r: PrimExpr, j: int) -> PrimExpr:
            return ug[r, j]

    v = wf.vector
    h = te.compute((rows,), lambda r: _combine(form, proj(r, 0), proj(r, 1) if gated else None), name=H_STAGE)

    def term(r: PrimExpr, k: PrimExpr) -> PrimExpr:
        value = wf.load(w_down, (neuron(r),), k // v, k % v, scale=h[r])
        return tirx.if_then_else(live(r), value, f32(0)) if live else value

    r = te.placeholder((hidden,), "float32", name="r")
    y_part, y = sliced_axpy(hidden, rows, term, r if residual else None)
    tail = [*([(r, "in")] if residual else []), (ug, "scratch"), (y_part, "scratch"), (y, "out")]
    if not indexed:
        return make_kernel(name, "dense_ffn", [*args, *tail], options={"vector": v})
    guard = lambda b, r, j: r < b["count"][0]  # noqa: E731
    # Without a bias a row past count adds exactly zero even if computed: its dot products are
    # zero (the gather-GEMV stores a skipped row's zeroed sum), every form's h(0, 0) is 0, and its
    # index (0 past count, and clamped) names a real down row. A GPU schedule may then load a live
    # trip's rows unconditionally (``guards.apply_guards``' eager blocks).
    options = {"vector": v, "dead_rows_zero": int(not bias)}
    return make_kernel(name, "sparse_ffn", [*args, *tail], guards={"ug": guard}, options=options)


def sliced_axpy(hidden: int, rows: int, term: Callable[[PrimExpr, PrimExpr], PrimExpr],
                residual: te.Tensor | None = None) -> tuple[te.Tensor, te.Tensor]:
    """``y[k] = sum_r term(r, k)`` over ``rows`` in slices (see the module docstring): the partial
    rows ``y_part`` [S, hidden] (scratch) and ``y`` [hidden]; with a ``residual`` r, the slices'
    sum plus ``r[k]``, added last (one term more in the same reduction: no launch of its own)."""
    slices = gpu_layout.axpy_slices(rows, hidden)
    i = te.reduce_axis((0, rows // slices), name="i")
    y_part = te.compute((slices, hidden), lambda s, k: te.sum(term(i * slices + s, k), axis=i), name="y_part")
    if residual is None:
        s = te.reduce_axis((0, slices), name="s")
        y = te.compute((hidden,), lambda k: te.sum(y_part[s, k], axis=s), name="y")
    else:
        s = te.reduce_axis((0, slices + 1), name="s")
        y = te.compute((hidden,), lambda k: te.sum(
            tirx.if_then_else(s < slices, y_part[s, k], residual[k]), axis=s), name="y")
    return y_part, y


def bias_add(name: str, n: int, residual: bool = False) -> Kernel:
    """``y = x + b (+ r)`` ([n] f32): a whole FFN layer's down bias, added to the partial sum its
    kernel left in the workspace, and with ``residual`` the decode step's residual add after it."""
    check_positive(n=n)
    x = te.placeholder((n,), "float32", name="x")
    b = te.placeholder((n,), "float32", name="b")
    r = te.placeholder((n,), "float32", name="r")
    y = te.compute((n,), lambda i: x[i] + b[i] + r[i] if residual else x[i] + b[i], name="y")
    return make_kernel(name, "elementwise", [(x, "in"), (b, "in"), *([(r, "in")] if residual else []), (y, "out")])


def gate_first_ffn(name: str, hidden: int, n_ff: int, form: str, fmt: str, residual: bool = False) -> Kernel:
    """Exact gate-first FFN of a GLU form: only neurons with ``|act(gate . x)| * score_scale > threshold``
    count.

    Parameters: ``x``, ``threshold`` [1] and ``score_scale`` [n_ff] (the layer's, inputs so layers
    share the kernel; an unscaled layer passes ones), the buffers of ``gate``, ``up`` and ``down``
    [n_ff, hidden] (down neuron-major) in ``fmt``, ``r`` [hidden] with ``residual``, scratch ``g``
    and ``u`` [n_ff] and ``y_part`` [S, hidden], output ``y`` [hidden].
    """
    check_positive(hidden=hidden, n_ff=n_ff)
    spec = _form(form)
    act = spec.act
    if not spec.gated or spec.act_on_up:
        raise PiccError(f"{name}: gate-first needs a GLU form whose score is |act(gate)| "
                        f"(swiglu, reglu, geglu, geglu_tanh), got {form!r}")
    wf = WeightFormat(fmt)
    x = te.placeholder((hidden,), "float32", name="x")
    threshold = te.placeholder((1,), "float32", name="threshold")
    scale = te.placeholder((n_ff,), "float32", name="score_scale")
    w_gate = wf.placeholders("gate", (n_ff,), hidden)
    w_up = wf.placeholders("up", (n_ff,), hidden)
    w_down = wf.placeholders("down", (n_ff,), hidden)
    thr = threshold[0]
    g = row_dot("g", wf, w_gate, lambda r, k: x[k], (n_ff,), hidden)

    def active(r: PrimExpr) -> PrimExpr:
        return tirx.abs(activation(act, g[r])) * scale[r] > thr

    u = row_dot("u", wf, w_up, lambda r, k: x[k], (n_ff,), hidden, when=active)
    v = wf.vector
    h = te.compute((n_ff,), lambda r: activation(act, g[r]) * u[r], name=H_STAGE)
    live = te.compute((n_ff,), active, name=LIVE_STAGE)

    def term(r: PrimExpr, k: PrimExpr) -> PrimExpr:
        value = wf.load(w_down, (r,), k // v, k % v, scale=h[r])
        return tirx.if_then_else(live[r], value, f32(0))

    r = te.placeholder((hidden,), "float32", name="r")
    y_part, y = sliced_axpy(hidden, n_ff, term, r if residual else None)

    def guard(b: dict[str, tirx.Buffer], r: PrimExpr) -> PrimExpr:
        return tirx.abs(activation(act, b["g"][r])) * b["score_scale"][r] > b["threshold"][0]

    args = [(x, "in"), (threshold, "in"), (scale, "in"), *[(t, "in") for t in (*w_gate, *w_up, *w_down)],
            *([(r, "in")] if residual else []), (g, "scratch"), (u, "scratch"), (y_part, "scratch"), (y, "out")]
    return make_kernel(name, "gate_first_ffn", args, guards={"u": guard}, options={"vector": v})
