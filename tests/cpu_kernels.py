"""What the CPU kernel tests (``test_codegen_cpu_*.py``) share: random weights, float64 references
and the fused FFN's cases, and the tolerances.

Tolerances, as relative errors ``max|out - ref| / max|ref|`` against a float64 numpy reference:

* f32 weights: 1e-5. The kernels accumulate in float32 in a different order than numpy; the sum of
  k products carries ~sqrt(k) * 6e-8 relative rounding error (measured ~1e-7 at k <= 1000), so
  1e-5 fails only on a real mistake (a wrong element, a missed row, a dropped bias).
* f16 / q8_0 / q4_0 / q4_1 weights: 1e-4 against numpy on the *same dequantised weights*
  (``picc.quant.dequantize``), so quantisation error is not part of it; the kernels scale once per
  32-block instead of per element, a few extra roundings (measured ~3e-7).
* Dequantisation alone (embedding lookup) and anything a thread count could change only by a race
  are checked bit for bit.
"""

from __future__ import annotations

import numpy as np
from scipy.special import erf

from picc import kernel_names as names
from picc import quant
from picc.codegen_cpu import CpuModule, ThreadTeam, aligned_zeros, dotplanes, rowplanes
from picc.codegen_cpu.kernel import Kernel
from picc.codegen_cpu.kernels_dense import dense_ffn
from picc.codegen_cpu.kernels_ffn import FORMS, ffn_scratch_bytes, sparse_ffn

DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
THREADS = (1, 2, 3)
GATED_FORMS = tuple(f for f, s in FORMS.items() if s.gated)
F32_TOL, QUANT_TOL = 1e-5, 1e-4


def tol(dtype: str) -> float:
    return F32_TOL if dtype == "f32" else QUANT_TOL


PLANES_MODES = (("predictor", True), ("predictor", False), ("gate-first", False))  # int x: dotplanes rows


def ffn_kernels() -> list[Kernel]:
    ks = [sparse_ffn("predictor", "swiglu", d, d, d, il) for d in DTYPES for il in (False, True)]
    ks += [sparse_ffn("predictor", f, "f16", "f16" if s.gated else None, "f16") for f, s in FORMS.items()]
    ks += [sparse_ffn("predictor", f, "f16", "f16", "f16", True) for f, s in FORMS.items() if s.gated]
    ks += [dense_ffn(f, d, d if FORMS[f].gated else None, d) for f in ("swiglu", "relu") for d in ("f32", "q4_1")]
    ks += [dense_ffn("swiglu", d, d, d, x_format) for d in ("q4_0", "q4_1") for x_format in ("f32", "i16")]
    ks += [dense_ffn("swiglu", d, d, d, x, True) for d in ("q4_0", "q4_1") for x in ("f32", "i16", "i8")]
    ks += [sparse_ffn(m, "swiglu", d, d, d) for m in ("dense", "gate-first", "down-only") for d in ("f16", "q4_0")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, il, x_format="i16") for m, il in (("predictor", True), ("gate-first", False))
           for d in ("q4_0", "q4_1")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, il, x_format=x, gathered="dotplanes") for m, il in PLANES_MODES
           for d in ("q4_0", "q4_1") for x in ("i16", "i8")]
    ks += [sparse_ffn(m, "swiglu", d, d, d, False, x, dense_rows8=True) for d in ("q4_0", "q4_1")
           for x in ("f32", "i16", "i8") for m in ("gate-first", "down-only")]
    ks += [sparse_ffn("gate-first", "swiglu", "q4_1", "q4_1", "q4_1")]
    ks += [sparse_ffn("down-only", "relu", d, None, d, dense_rows8=True) for d in ("q4_0", "q4_1")]
    ks += [sparse_ffn("gate-first", "drelu", "f32", "f32", "f32"), sparse_ffn("down-only", "relu", "q8_0", None, "q8_0"),
           sparse_ffn("down-only", "drelu", "f16", "f16", "f16"), sparse_ffn("predictor", "swiglu", "q4_1", "q8_0", "f16")]
    return ks


def run(module: CpuModule, team: ThreadTeam, kernel: Kernel, *args: object) -> None:
    """Call ``kernel`` on every thread of ``team``; numpy arrays are passed as pointers."""
    fn = module.function(kernel.symbol, kernel.argtypes)
    team.run(fn, [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args])


def weights(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0):
    """(raw bytes in ``dtype``, the float32 values they decode to)."""
    raw = quant.quantize(rng.normal(0, scale, size=shape).astype(np.float32), dtype)
    return raw, quant.dequantize(raw, dtype, shape)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def width(dtype: str, plain: int = 100) -> int:
    """Row length: a multiple of 32 for block formats, one with a tail (not a multiple of 32) else."""
    return 96 if quant.BLOCK_SIZE.get(dtype) else plain


def act64(name: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    if name == "relu":
        return np.maximum(x, 0)
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + erf(x / np.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gap_threshold(scores: np.ndarray, keep: float) -> float:
    """A threshold keeping about ``keep`` of ``scores``, halfway across a gap between two of them,
    so float32-vs-float64 rounding cannot move any score across it."""
    s = np.sort(np.abs(scores))
    i = int(np.clip(len(s) * (1 - keep), 1, len(s) - 1))
    while i < len(s) - 1 and s[i] - s[i - 1] < 1e-3 * s[-1]:
        i += 1
    return float((s[i] + s[i - 1]) / 2)


class FfnCase:
    """Random FFN weights of one form and the float64 reference of every mode."""

    def __init__(self, form: str, dtypes: tuple[str, str | None, str], n: int = 101, hidden: int | None = None,
                 biases: bool = False, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.spec = FORMS[form]
        self.n = n
        self.hidden = hidden or (96 if any(quant.BLOCK_SIZE.get(d or "") for d in dtypes) else 100)
        h = self.hidden
        self.x = rng.normal(size=h).astype(np.float32)
        self.up_dtype, self.gate_dtype = dtypes[0], dtypes[1]
        self.up_raw, self.up = weights(rng, (n, h), dtypes[0], h**-0.5)
        self.gate_raw, self.gate = weights(rng, (n, h), dtypes[1], h**-0.5) if dtypes[1] else (None, None)
        self.down_raw, self.down = weights(rng, (n, h), dtypes[2], n**-0.5)
        # The kernels read a block-format down_t in the rowplanes layout (the .pib stores it so).
        self.down_t = (rowplanes.to_rowplanes(self.down_raw, dtypes[2], (n, h)) if dtypes[2] in rowplanes.DTYPES
                       else self.down_raw)
        rand = (lambda size: rng.normal(0, 0.1, size=size).astype(np.float32)) if biases else (lambda size: None)
        self.up_bias, self.gate_bias, self.down_bias = rand(n), rand(n) if dtypes[1] else None, rand(h)

    def act_gate(self) -> np.ndarray:
        g = self.gate.astype(np.float64) @ self.x + (0 if self.gate_bias is None else self.gate_bias)
        return act64(self.spec.act, g)

    def h(self) -> np.ndarray:
        u = self.up.astype(np.float64) @ self.x + (0 if self.up_bias is None else self.up_bias)
        if not self.spec.gated:
            return act64(self.spec.act, u)
        return self.act_gate() * (act64(self.spec.act, u) if self.spec.act_on_up else u)

    def reference(self, active: np.ndarray) -> np.ndarray:
        y = np.where(active, self.h(), 0) @ self.down.astype(np.float64)
        return y + (0 if self.down_bias is None else self.down_bias)

    def run(self, module, team, kernel, *, active=None, threshold=0.0, score_scale=None, interleaved=False,
            y0=None, planes=()):
        """(y after the call, the kernel's count). ``y`` starts as garbage, which the kernel
        overwrites, or as ``y0``, which it adds its result to (``accumulate``). ``planes``: the
        matrices ("up", "gate") the kernel reads in the dotplanes layout (:func:`planes_of`)."""
        y = np.full(self.hidden, np.nan, np.float32) if y0 is None else y0.astype(np.float32)
        mask = np.zeros(self.n, np.uint8) if active is None else active.astype(np.uint8)
        count = np.array([-1], np.int32)
        scratch = aligned_zeros(ffn_scratch_bytes(self.n, self.hidden, team.nthreads))
        up, gate, up_bias, gate_bias = self.up_raw, self.gate_raw, self.up_bias, self.gate_bias
        if "up" in planes:
            up = dotplanes.to_dotplanes(up, self.up_dtype, (self.n, self.hidden))
        if "gate" in planes:
            gate = dotplanes.to_dotplanes(gate, self.gate_dtype, (self.n, self.hidden))
        if interleaved:  # up_gate [n, 2, row]: the gate argument points one row further
            both = np.ascontiguousarray(np.stack([up.reshape(self.n, -1), gate.reshape(self.n, -1)], 1))
            up, gate = both, both.reshape(-1)[both.shape[2]:]
            if self.up_bias is not None:
                biases = np.ascontiguousarray(np.stack([self.up_bias, self.gate_bias], 1))
                up_bias, gate_bias = biases, biases.reshape(-1)[1:]
        run(module, team, kernel, self.x, up, gate, self.down_t, up_bias, gate_bias,
            self.down_bias, y, mask, count, scratch, self.n, self.hidden, threshold, score_scale, int(y0 is not None))
        return y, int(count[0])


def planes_of(mode: str) -> tuple[str, ...]:
    """The matrices a fused FFN kernel with ``gathered="dotplanes"`` reads in that layout (as ``lower_ops`` stores them)."""
    return names.gathered_dotted(mode, "up", "gate")


def active_sets(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"empty": np.zeros(n, bool), "all": np.ones(n, bool), "some": rng.random(n) < 0.3,
            "one": np.arange(n) == n - 1}


def or_zero(bias: np.ndarray | None) -> np.ndarray | float:
    return 0.0 if bias is None else bias
