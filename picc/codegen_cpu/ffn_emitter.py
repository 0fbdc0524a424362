"""What the emitters of the two fused FFN kernels share: a neuron's arithmetic and the checks.

:func:`picc.codegen_cpu.kernels_ffn.sparse_ffn` (decode: one token, its active neurons' rows
gathered) and :func:`picc.codegen_cpu.kernels_prefill.chunk_ffn` (prefill: a chunk of tokens, each
weight row read once) compute the same function of each token with different loop nests. What a
neuron computes is theirs in common and is written here once: which kernels make sense
(:func:`check_ffn_kernel`), the row strides of up, gate and down (interleaved or not),
``act(gate . x + gate_bias)``, ``h`` from the projections (:func:`emit_h`, which the dense FFN and
the prefill's activation kernel use too) and the activity scores tested against ``threshold``
(:class:`FfnEmitter`). Each kernel's emitter subclasses :class:`FfnEmitter` and adds its phases.
"""

from __future__ import annotations

from picc import kernel_names as names
from picc.codegen_cpu.irtext import F32, Fn, fconst
from picc.codegen_cpu.rowformats import NIBBLE_DTYPES, check_dtype, emit_row_bytes
from picc.errors import PiccError
from picc.ir.ops import FFN_FORMS, FfnForm

FORMS = FFN_FORMS  # how each FFN form combines its projections: the IR's own table
MODES = ("predictor", "dense", "gate-first", "down-only")
LINE = 64  # bytes of a cache line: scratch regions start on one


def round_line(nbytes: int) -> int:
    """``nbytes`` rounded up to whole cache lines."""
    return -(-nbytes // LINE) * LINE


def ffn_form(form: str) -> FfnForm:
    """The spec of FFN ``form`` (an error naming the forms when there is none)."""
    if form not in FORMS:
        raise PiccError(f"codegen_cpu: FFN form {form!r} is not one of {', '.join(FORMS)}")
    return FORMS[form]


def gated_form(form: str, gate_dtype: str | None) -> FfnForm:
    """:func:`ffn_form`, after checking that a gate is given exactly when the form has one."""
    spec = ffn_form(form)
    if spec.gated != (gate_dtype is not None):
        raise PiccError(f"codegen_cpu: FFN form {form!r} {'needs' if spec.gated else 'takes no'} gate weights")
    return spec


def check_ffn_kernel(mode: str, form: str, up_dtype: str, gate_dtype: str | None, down_dtype: str,
                     interleaved: bool, dense_rows8: bool = False) -> FfnForm:
    """The form's spec, after checking that a fused FFN kernel of these parameters makes sense."""
    if mode not in MODES:
        raise PiccError(f"codegen_cpu: FFN mode {mode!r} is not one of {', '.join(MODES)}")
    spec = gated_form(form, gate_dtype)
    if mode == "gate-first" and not spec.gated:
        raise PiccError(f"codegen_cpu: FFN mode 'gate-first' needs a gated form, got {form!r}")
    for d in (up_dtype, gate_dtype or "f32", down_dtype):
        check_dtype(d)
    if down_dtype == "mxfp4":  # the AXPYs of block rows read the rowplanes layout alone
        raise PiccError("codegen_cpu: a fused FFN's neuron-major down rows are q8_0 / q4_0 / q4_1 in the rowplanes "
                        "layout or f32 / f16, not mxfp4 (neuron-major-down makes an mxfp4 down q8_0)")
    if interleaved and (not spec.gated or gate_dtype != up_dtype or mode == "gate-first"):
        raise PiccError(f"codegen_cpu: interleaved up/gate rows need a gated form, one format and a mode that "
                        f"gathers both rows, got {form!r} {mode!r}")
    whole = names.read_whole(mode, up_dtype, gate_dtype)
    if dense_rows8 and not (whole and set(whole) <= NIBBLE_DTYPES):
        raise PiccError(f"codegen_cpu: matrices in the rows8 layout need gate-first or down-only mode, whose whole "
                        f"matrices are q4_0 / q4_1, got {mode!r} with {up_dtype} up and {gate_dtype} gate")
    return spec


def _if_given(fn: Fn, op: str, value: str, vector: str, i: str, stride: int = 1, ty: str = F32) -> str:
    """``value <op> vector[stride * i]`` (``ty`` elements: a float, or a span of floats from there),
    or ``value`` when the optional ``vector`` is null."""
    out = fn.var(ty, value, "vg")
    with fn.if_(fn.v(f"icmp ne ptr {vector}, null", "given")):
        out.set(fn.v(f"{op} {ty} {out.get()}, {fn.load(ty, fn.at(vector, 4 * stride, i), 4, 'e')}", "ve"))
    return out.get()


def plus_bias(fn: Fn, value: str, bias: str, i: str, stride: int = 1) -> str:
    """``value + bias[stride * i]``, or ``value`` when ``bias`` is null."""
    return _if_given(fn, "fadd", value, bias, i, stride)


def times_scale(fn: Fn, value: str, i: str, ty: str = F32) -> str:
    """``value * score_scale[i]`` (a gate-first layer's per-neuron score scale; ``ty`` a vector type:
    the span from i), or ``value`` when the layer has none (a null ``%score_scale``)."""
    return _if_given(fn, "fmul", value, "%score_scale", i, ty=ty)


def fabs(fn: Fn, v: str) -> str:
    """``|v|`` of a float."""
    return fn.v(f"call float @llvm.fabs.f32(float {v})", "abs")


def emit_h(fn: Fn, spec: FfnForm, a: str | None, u: str) -> str:
    """``h`` of ``spec``'s form from ``a = act(gate)`` (None for the ungated forms) and ``u``, the up
    projection with its bias: ``a * u``, ``a * act(u)`` (dReLU) or ``act(u)``."""
    act = f"@picc_act_{spec.act}"
    if a is None:
        return fn.v(f"call float {act}(float {u})", "h")
    if spec.act_on_up:
        u = fn.v(f"call float {act}(float {u})", "au")
    return fn.v(f"fmul float {a}, {u}", "h")


def any_nonzero(fn: Fn, values: list[str], hint: str) -> str:
    """An i1: whether some float of ``values`` is not zero (``hint`` names the result)."""
    test = fn.v(f"fcmp one float {values[0]}, 0.0", hint)
    for v in values[1:]:
        test = fn.v(f"or i1 {test}, {fn.v(f'fcmp one float {v}, 0.0', 'nz')}", hint)
    return test


def load_index(fn: Fn, ids: str, k: str) -> str:
    """``ids[k]`` (an i32 array of neuron numbers) as an i64."""
    return fn.sext(fn.load("i32", fn.at(ids, 4, k), 4, "nid"), "nid")


class FfnEmitter:
    """One fused FFN kernel being emitted into ``fn``: its parameters and a neuron's arithmetic.

    Biases and the score scale are the kernels' own parameters (``%up_bias``, ``%gate_bias``,
    ``%score_scale``, ``%threshold``); with ``interleaved`` weights neuron i's biases are elements
    ``2 i`` (up) and, one later, of the gate's (``up_gate`` rows alternate).
    """

    def __init__(self, fn: Fn, mode: str, spec: FfnForm, up_dtype: str, gate_dtype: str | None, down_dtype: str,
                 interleaved: bool, dense_rows8: bool) -> None:
        self.fn, self.mode, self.spec = fn, mode, spec
        self.up_dtype, self.gate_dtype, self.down_dtype = up_dtype, gate_dtype, down_dtype
        self.interleaved, self.dense_rows8 = interleaved, dense_rows8
        self.bias_stride = 2 if interleaved else 1
        self.rb_up = self.rb_gate = self.rb_down = ""

    def emit_row_bytes(self, hidden: str) -> None:
        """The byte strides between neurons of up, gate (when gated) and down, rows of ``hidden``."""
        fn = self.fn
        self.rb_up = emit_row_bytes(fn, self.up_dtype, hidden)
        self.rb_down = emit_row_bytes(fn, self.down_dtype, hidden)
        self.rb_gate = emit_row_bytes(fn, self.gate_dtype, hidden) if self.gate_dtype else ""
        if self.interleaved:  # neuron i's up row, then its gate row: each matrix steps two rows at a time
            self.rb_up = self.rb_gate = fn.v(f"shl i64 {self.rb_up}, 1", "rb2")

    def row(self, matrix: str, row_bytes: str, i: str, hint: str = "row", offset_hint: str = "ro") -> str:
        """Neuron i's row of ``matrix``, ``row_bytes`` apart."""
        return self.fn.gep(matrix, self.fn.v(f"mul i64 {i}, {row_bytes}", offset_hint), hint)

    def gate_act(self, i: str, g: str) -> str:
        """``act(gate[i] . x + gate_bias[i])`` from the dot product ``g``."""
        bias = plus_bias(self.fn, g, "%gate_bias", i, self.bias_stride)
        return self.fn.v(f"call float @picc_act_{self.spec.act}(float {bias})", "a")

    def up(self, i: str, u: str) -> str:
        """``up[i] . x + up_bias[i]`` from the dot product ``u``."""
        return plus_bias(self.fn, u, "%up_bias", i, self.bias_stride)

    def h(self, a: str | None, u: str) -> str:
        """:func:`emit_h` of the kernel's form."""
        return emit_h(self.fn, self.spec, a, u)

    def gate_score(self, a: str, i: str) -> str:
        """Gate-first's score of neuron i from ``a = act(gate)``: ``|a|`` times its score scale;
        for dReLU only ``|a|``, whose test against :attr:`gate_cut` is ``relu(g) > 0``: its
        score is ``|h|``, decided after up (:meth:`h_passes`)."""
        v = fabs(self.fn, a)
        return v if self.spec.act_on_up else times_scale(self.fn, v, i)

    @property
    def gate_cut(self) -> str:
        """What :meth:`gate_score` must exceed: the threshold; for dReLU 0 (``relu(g) = 0`` means
        ``h = 0``)."""
        return fconst(0.0) if self.spec.act_on_up else "%threshold"

    def h_passes(self, h: str, i: str, hint: str) -> str:
        """An i1: dReLU's gate-first test, ``|h|`` times neuron i's score scale above the threshold."""
        return self.fn.v(f"fcmp ogt float {times_scale(self.fn, fabs(self.fn, h), i)}, %threshold", hint)
