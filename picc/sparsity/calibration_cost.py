"""What calibrating a model would cost on this machine, estimated before it starts.

Under the ``fisher`` threshold rule, ``profile-activations`` is one torch pass block by block
(``picc.sparsity.fisher``): a forward over all the calibration tokens, where the profile is
taken, then each block's forward again and its backward over the first ``fisher_tokens``: one
forward a token plus two a Fisher token. Under the others it runs the model's forward in numpy (op
by op over all the windows, as many windows at once as there are cores, each on one BLAS thread);
where predictors are trained after it (``insert-predictors``), another such forward gathers their
data (unless they train on the profiled tokens, whose FFN inputs profiling then keeps for them),
and each layer's predictor trains on a torch thread, at the rank the predictor budget allows. All
of it is float32 matrix products, so the estimate is their multiply-adds at the rate this
machine's numpy (one BLAS thread on each of the windows' threads) and torch multiply matrices of
the model's width, measured here in a fraction of a second, divided by ``EFFICIENCY``, plus the
time to dequantize the weights read (twice in the Fisher pass), at the rate measured on the
model's own format. Memory: a thresholded layer's scores for every calibration token (float32)
stay until the thresholds are calibrated, beside ``WeightStore.f32``'s cache.

On the 2-core build VM (AMD EPYC, Zen 4; torch ~150 GFLOP/s, Q4_0 dequantized at ~0.6-1 GB/s of
float32), a SwiGLU LLaMA-7B Q4_0 took 826 s to calibrate on 4096 tokens (2048 of them for the
Fisher scales), estimated at ~14 minutes; a 1B shape in f16, 159 s. Before the dequantization was
counted apart, the efficiency that matched (0.5) hid it: 256 tokens of the 7B took 154 s of
Fisher scales, half of it dequantizing each block twice for one window's products.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np

from picc.blas import blas_threads
from picc.frontend.model import LoadedModel
from picc.ir import ops as O
from picc.ir.types import DType
from picc.ir.weights import F32_CACHE_BYTES, Tensor, WeightStore
from picc.sparsity.predictors import MIN_RANK, first_ranks, starting_rank, training_flops
from picc.sparsity.profiling import RELU_FORMS, ffn_ops, scaled_layers
from picc.targets.host import host_cores

EFFICIENCY = 0.8
"""The share of the measured matrix-product rate the calibration passes reach (see above)."""


@dataclass(frozen=True)
class CalibrationCost:
    """The estimated seconds of each calibration pass and the bytes profiling holds."""

    fisher_seconds: float  # the Fisher pass, which takes the profile too; 0 when the fisher rule does not apply
    profile_seconds: float  # a profiling pass of its own; 0 under the fisher rule
    memory_bytes: int
    predictor_seconds: float = 0.0  # the predictors' data (a forward pass) and their training

    @property
    def seconds(self) -> float:
        return self.fisher_seconds + self.profile_seconds + self.predictor_seconds

    def describe(self) -> str:
        what = "Fisher scales and the profile in one pass" if self.fisher_seconds else "profiling"
        if self.predictor_seconds:
            what += f" ~{(self.seconds - self.predictor_seconds) / 60:.0f}, training predictors " \
                    f"~{self.predictor_seconds / 60:.0f}"
        return f"~{self.seconds / 60:.0f} min ({what})"


@dataclass(frozen=True)
class PredictorWork:
    """The predictors ``insert-predictors`` would train: for the ffn ops ``layers``, on ``tokens``
    calibration tokens, all of them within ``budget_params`` parameters; ``own_forward``: their data
    takes a forward of its own (not where profiling keeps what it saw of the same tokens)."""

    layers: list[O.FFN]
    tokens: int
    budget_params: int
    own_forward: bool = True


def calibration_cost(model: LoadedModel, tokens: int, rule: str, targeted: bool, window: int = 256,
                     fisher_tokens: int | None = None, predictors: PredictorWork | None = None) -> CalibrationCost:
    """The cost of calibrating ``model`` on ``tokens`` tokens in windows of ``window`` under
    threshold ``rule`` (``targeted``: a target sparsity is given, so non-ReLU layers are
    thresholded), the Fisher scales' gradients taken on ``fisher_tokens`` of them (all: None),
    and of training ``predictors``."""
    module, weights = model.module, model.weights
    ops = list(module.ops())
    last_ffn = max(i for i, op in enumerate(ops) if isinstance(op, O.FFN))
    profiled = forward = 0  # multiply-adds a token: up to the last FFN (profiling), all (Fisher)
    profiled_weights, forward_weights = [], []
    for i, op in enumerate(ops):
        names = [n for n in ((op.weight,) if isinstance(op, O.Linear) else (op.up, op.gate, op.down)
                             if isinstance(op, O.FFN) else ()) if n is not None]
        macs = sum(math.prod(weights[n].shape) for n in names)
        forward, forward_weights = forward + macs, forward_weights + names
        if i <= last_ffn:
            profiled, profiled_weights = profiled + macs, profiled_weights + names
    ffns = ffn_ops(module)
    width = weights[ffns[0].up].shape[1]
    lanes = max(1, min(host_cores(), -(-tokens // window)))  # windows profiled at once
    numpy_rate, torch_rate = _rates(width, lanes)
    predictor_seconds = 0.0
    if predictors and predictors.layers:
        if predictors.own_forward:  # the data: a forward up to the last FFN over the training tokens
            predictor_seconds = 2 * profiled * predictors.tokens / (numpy_rate * EFFICIENCY) \
                + _dequantizing(weights, profiled_weights, 1)
        predictor_seconds += _training_flops(weights, predictors) / (
            _torch_one_thread_rate() * host_cores() * EFFICIENCY)
    fisher = rule == "fisher" and targeted and bool(scaled_layers(module))
    thresholded = [op for op in ffns if targeted and op.form not in RELU_FORMS]
    scores = sum(4 * tokens * weights[op.up].shape[0] for op in thresholded)
    if fisher:  # a forward, then each block's forward again and its backward: each weight read twice
        graded = tokens if fisher_tokens is None else min(tokens, -(-fisher_tokens // window) * window)
        seconds = 2 * forward * (tokens + 2 * graded) / (torch_rate * EFFICIENCY) \
            + _dequantizing(weights, forward_weights, 2)
        return CalibrationCost(seconds, 0.0, scores + F32_CACHE_BYTES, predictor_seconds)
    seconds = 2 * profiled * tokens / (numpy_rate * EFFICIENCY) + _dequantizing(weights, profiled_weights, 1)
    return CalibrationCost(0.0, seconds, scores + F32_CACHE_BYTES, predictor_seconds)


SEARCH_ROUNDS = 2
"""Predictor training's work, in rounds at the first ranks: the search (``predictors.train_all``)
trains each layer at ranks doubling from its start up to what pays or the budget allows, or halving
from it, so about twice a round at the ranks it ends near. The synthetic ReLU LLaMA-7B trained ranks
128 then 256 (25 of 32 layers): 1.3 rounds at the estimate's first ranks, in 10.3 minutes where
one round was estimated at 4."""


def _training_flops(weights: WeightStore, work: PredictorWork) -> float:
    """Predictor training (``predictors.train_all``): before profiling the densities are unknown,
    so each layer starts at the rank a density of 1/2 with dominant neurons would, the largest
    halved until all fit the budget, as ``train_all`` halves them; ``SEARCH_ROUNDS`` such rounds."""
    dims = {op.result: (weights[op.up].shape[1], weights[op.up].shape[0]) for op in work.layers}
    start = {k: starting_rank(h, n, 0.5, 1.0) for k, (h, n) in dims.items()}
    try:
        ranks = first_ranks(dims, start, work.budget_params)
    except ValueError:  # the pass will say so; the smallest ranks until then
        ranks = dict.fromkeys(dims, MIN_RANK)
    return SEARCH_ROUNDS * sum(training_flops(*dims[k], ranks[k], work.tokens) for k in dims)


def _dequantizing(weights: WeightStore, names: list[str], passes: int) -> float:
    """Seconds to dequantize ``names`` to float32 in each of ``passes`` passes (once in all when
    their float32 values fit ``WeightStore.f32``'s cache), at the rate this machine dequantizes
    each storage format."""
    f32_bytes: dict[tuple[DType, int], int] = {}
    for name in names:
        t = weights[name]
        key = (t.dtype, t.shape[-1])
        f32_bytes[key] = f32_bytes.get(key, 0) + 4 * math.prod(t.shape)
    if sum(f32_bytes.values()) <= F32_CACHE_BYTES:
        passes = 1
    return sum(passes * nbytes / _dequantize_rate(dtype, width) for (dtype, width), nbytes in f32_bytes.items())


@cache
def _dequantize_rate(dtype: DType, width: int) -> float:
    """Float32 bytes a second that dequantizing 512 rows of ``width`` stored as ``dtype`` gives:
    the best of three. Measured once a process, so estimates of several token counts agree."""
    values = np.random.default_rng(0).standard_normal((512, width), dtype=np.float32)
    rows = Tensor.from_f32(values, dtype)
    return values.nbytes / _best_seconds(rows.to_f32, 3)


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``run``, after one untimed (torch starts its
    threads): the best, so that another process's burst does not look like the machine."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return max(min(seconds), 1e-9)


@cache
def _torch_one_thread_rate() -> float:
    """Float32 flop/s of torch on one thread (as predictors train, a layer a thread) on a batch of
    256 times a 4096 x 512 matrix: the best of five."""
    import torch

    x, w = torch.randn(256, 4096), torch.randn(512, 4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return 2 * 256 * 512 * 4096 / _best_seconds(lambda: x @ w.T, 5)
    finally:
        torch.set_num_threads(threads)


@cache
def _rates(width: int, lanes: int) -> tuple[float, float]:
    """Float32 matrix-product rates (flop/s) of numpy, ``lanes`` threads at once on one BLAS thread
    each (as ``Interpreter.run_many`` runs windows), and of torch, on a 256-token window times a
    ``width``-wide matrix of 2048 rows: the best of eight."""
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, width), dtype=np.float32)
    w = rng.standard_normal((2048, width), dtype=np.float32)
    flops = 2 * x.shape[0] * w.shape[0] * width

    with blas_threads(1), ThreadPoolExecutor(lanes) as pool:
        numpy_rate = lanes * flops / _best_seconds(lambda: list(pool.map(lambda _: x @ w.T, range(lanes))), 8)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    return numpy_rate, flops / _best_seconds(lambda: tx @ tw.T, 8)
