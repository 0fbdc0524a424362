"""Training activation predictors: one low-rank MLP per FFN layer (hidden -> r -> n_ff).

PowerInfer's predictor training code was never released; this is picc's. A predictor sees the
FFN's input and guesses which neurons will be active under the profiling rule (activity score >
the layer's threshold). Its decision threshold favours recall: a missed active neuron costs
accuracy, an extra one only time.

Calibration tokens are split, for a seed, into train (80%), threshold (10%) and test (10%). The
threshold is set on the threshold split for the recall target; recall and predicted density are
measured on the test split. A rank *meets the target* when its test recall is within
``RECALL_SLACK`` of it. What a token pays for a predictor layer is the predictor's bytes plus the
predicted share of the FFN's bytes, so the rank search minimises that: ranks start from the
layer's density and skew, double while that lowers the bytes (or while recall is short of the
target), halve when the first doubling did not pay, and stop at the budget for all predictors.
Measured on relu-demo: rank 16 predicts 31-76% of the neurons active at 0.99 recall, rank 64
8-48% (true density 3-36%); more calibration tokens and steps helped as much as rank.

The learning rate and the passes over the data (``LEARNING_RATE``, ``EPOCHS``, ``MIN_STEPS``) set
what training costs, most of a 7B model's calibration. Mean predicted density at 0.99 recall, each
layer at its starting rank (lower is better), against the old setting (20 passes, at least 300
steps, Adam at 2e-3): relu-demo on 16384 tokens 0.305 after 10 passes at 5e-3 (512 steps) against
0.311 (1023 steps); on its first 4096 tokens 0.406 after 200 steps against 0.473 after 300; five
layers of SmolLM2 in predictor mode 0.936 against 0.939; two layers of the synthetic ReLU LLaMA-7B
(4096 tokens, where ``MIN_STEPS`` sets the steps) at rank 128 0.330 after 200 steps against 0.329
after 300, at rank 256 0.270 against 0.267. At 1e-2, better still on relu-demo (0.298 after 10
passes), the 7B's rank-256 predictors trained badly (0.391).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

RECALL_SLACK = 0.01
MAX_STEPS = 1500
MIN_STEPS = 200
EPOCHS = 10  # passes over the train split, within the step limits
BATCH = 256
LEARNING_RATE = 5e-3  # Adam's, annealed to 0 over the steps (cosine)
TRAIN_SHARE = 0.8  # of the calibration tokens, the train split (then 10% threshold, 10% test)
# The GPU's warp-per-row predictor kernel splits each fc2 row into 16-byte chunks across lanes;
# below rank 16 an f16 row is a single chunk, which its schedule does not handle.
MIN_RANK = 16


@dataclass(frozen=True)
class LayerData:
    """Calibration tokens of one FFN layer: its inputs and which neurons were active."""

    x: np.ndarray  # [tokens, hidden] float32
    active: np.ndarray  # [tokens, n_ff] bool

    @property
    def density(self) -> float:
        return float(self.active.mean())


class LayerDataRecorder:
    """An ``Interpreter.on_ffn`` that writes the inputs and active neurons (activity score > the
    op's threshold, 0 without one) of the ffn ops named in ``shapes`` (their hidden and n_ff) into
    arrays of all ``n_tokens`` tokens, window after window: a 7B model's are 3.5 GB, so there is
    no second copy."""

    def __init__(self, shapes: dict[str, tuple[int, int]], n_tokens: int) -> None:
        self.data = {k: LayerData(np.empty((n_tokens, hidden), np.float32), np.empty((n_tokens, n_ff), bool))
                     for k, (hidden, n_ff) in shapes.items()}
        self.filled = dict.fromkeys(shapes, 0)

    def __call__(self, trace) -> None:  # noqa: ANN001 - an interpreter FfnTrace
        k = trace.op.result
        if k in self.data:
            rows = slice(self.filled[k], self.filled[k] + len(trace.x))
            self.data[k].x[rows] = trace.x
            np.greater(trace.score, np.float32(trace.op.threshold or 0.0), out=self.data[k].active[rows])
            self.filled[k] = rows.stop

    @property
    def complete(self) -> bool:
        return all(self.filled[k] == len(d.x) for k, d in self.data.items())


@dataclass(frozen=True)
class TrainedPredictor:
    """Weights (as float16-exact float32 arrays) and what the predictor reached on test tokens."""

    fc1: np.ndarray  # [rank, hidden]
    fc1_bias: np.ndarray  # [rank]
    fc2: np.ndarray  # [n_ff, rank]
    fc2_bias: np.ndarray  # [n_ff]
    threshold: float
    recall: float  # on the test split
    predicted_density: float  # share of neurons predicted active on the test split
    true_density: float

    @property
    def rank(self) -> int:
        return self.fc1.shape[0]

    def meets(self, recall_target: float) -> bool:
        return self.recall >= recall_target - RECALL_SLACK

    def bytes_per_token(self, ffn_bytes: float) -> float:
        """The predictor's float16 weights plus the predicted share of the FFN's bytes."""
        return predictor_bytes(self.rank, self.fc1.shape[1], self.fc2.shape[0]) + self.predicted_density * ffn_bytes


def predictor_params(rank: int, hidden: int, n_ff: int) -> int:
    return rank * (hidden + 1) + n_ff * (rank + 1)


def predictor_bytes(rank: int, hidden: int, n_ff: int) -> int:
    """A predictor's bytes: its weights and biases are stored as float16."""
    return 2 * predictor_params(rank, hidden, n_ff)


def starting_rank(hidden: int, n_ff: int, sparsity: float, top20: float) -> int:
    """A first guess: proportional to the layer's density, halved when a few neurons dominate
    (relu-demo's best ranks were 32-64 for hidden 320 at 3-36% density)."""
    guess = min(hidden, n_ff) * max(1.0 - sparsity, 0.05)
    if top20 > 0.5:
        guess /= 2
    return int(2 ** max(4, math.floor(math.log2(max(guess, 1)))))


def training_steps(n_train: int) -> int:
    """Optimizer steps for ``n_train`` training tokens: ``EPOCHS`` passes within the step limits."""
    return min(MAX_STEPS, max(MIN_STEPS, EPOCHS * n_train // BATCH))


def training_flops(hidden: int, n_ff: int, rank: int, tokens: int) -> float:
    """Floating-point operations of training one predictor of ``rank`` on ``tokens`` calibration
    tokens: each step's forward (two products of a batch) and backward (twice that)."""
    return training_steps(int(TRAIN_SHARE * tokens)) * 6.0 * BATCH * rank * (hidden + n_ff)


def logits(p: TrainedPredictor, x: np.ndarray) -> np.ndarray:
    h = np.maximum(x @ p.fc1.T + p.fc1_bias, np.float32(0))
    return h @ p.fc2.T + p.fc2_bias


def split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    a, b = int(TRAIN_SHARE * n), int(0.9 * n)
    return order[:a], order[a:b], order[b:]


def train_predictor(data: LayerData, rank: int, recall_target: float, seed: int) -> TrainedPredictor:
    """Train one predictor of ``rank`` on ``data``; choose its threshold for ``recall_target``."""
    import torch

    # The matmuls are tiny: one thread is fastest, and on a busy machine a second thread that
    # spins waiting for a core made training 16x slower (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_predictor(data, rank, recall_target, seed)
    finally:
        torch.set_num_threads(threads)


def _train_predictor(data: LayerData, rank: int, recall_target: float, seed: int) -> TrainedPredictor:
    import torch

    train, calib, test = split(len(data.x), seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(data.x)
    y = torch.from_numpy(data.active.astype(np.float32))
    hidden, n_ff = data.x.shape[1], data.active.shape[1]
    model = torch.nn.Sequential(torch.nn.Linear(hidden, rank), torch.nn.ReLU(), torch.nn.Linear(rank, n_ff))
    # torch's default initialisation, drawn from a generator of our own: the global RNG would be
    # shared by the layers trained at once on other threads.
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for linear in (model[0], model[2]):
            bound = 1.0 / math.sqrt(linear.in_features)
            for param in (linear.weight, linear.bias):
                param.copy_(torch.from_numpy(rng.uniform(-bound, bound, tuple(param.shape)).astype(np.float32)))
    density = max(float(y[train].mean()), 1e-3)
    # Weight positives up (capped) so the loss, like the decision, cares more about misses.
    pos_weight = torch.tensor(min(8.0, max(1.0, (1 - density) / density)))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    steps = training_steps(len(train))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    train_idx = torch.from_numpy(train)
    for _ in range(steps):
        batch = train_idx[torch.randint(len(train_idx), (min(BATCH, len(train_idx)),), generator=gen)]
        opt.zero_grad()
        loss_fn(model(x[batch]), y[batch]).backward()
        opt.step()
        sched.step()
    # Stored as float16 (half the memory); the threshold is chosen for the rounded weights.
    fc1, fc2 = model[0], model[2]

    def f16(t: torch.Tensor) -> np.ndarray:
        return t.detach().numpy().astype(np.float16).astype(np.float32)

    p = TrainedPredictor(f16(fc1.weight), f16(fc1.bias), f16(fc2.weight), f16(fc2.bias), 0.0, 0.0, 0.0,
                         data.density)
    calib_logits = logits(p, data.x[calib])
    positives = calib_logits[data.active[calib]]
    threshold = float(np.quantile(positives, 1.0 - recall_target)) if positives.size else 0.0
    # The decision is "logit > threshold": step just below the quantile so it counts as a hit.
    threshold = float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))
    predicted = logits(p, data.x[test]) > threshold
    truth = data.active[test]
    recall = float((predicted & truth).sum() / max(1, truth.sum()))
    return TrainedPredictor(p.fc1, p.fc1_bias, p.fc2, p.fc2_bias, threshold, recall,
                            float(predicted.mean()), data.density)


def train_all(layers: dict[str, LayerData], start: dict[str, int], recall_target: float, budget_params: int,
              seed: int, progress: Callable[[str], None] | None = None,
              ffn_bytes: dict[str, float] | None = None, workers: int = 1,
              expect: Callable[[int], None] | None = None) -> dict[str, TrainedPredictor]:
    """Train every layer's predictor at the rank that costs a token the fewest bytes
    (``TrainedPredictor.bytes_per_token`` with the layer's ``ffn_bytes``, float16 by default)
    among those meeting the recall target, keeping all predictors within ``budget_params``.
    ``workers`` layers train at once (one torch thread each); the result does not depend on it.
    ``progress(k)`` is called as layer ``k``'s predictor is trained, ``expect(n)`` as a round of
    the search starts ``n`` of them."""
    import torch

    dims = {k: (d.x.shape[1], d.active.shape[1]) for k, d in layers.items()}
    cost_base = {k: float((ffn_bytes or {}).get(k, 2 * 3 * dims[k][0] * dims[k][1])) for k in layers}
    max_rank = _max_ranks(dims)
    ranks = first_ranks(dims, start, budget_params)
    total = sum(predictor_params(ranks[k], *dims[k]) for k in dims)

    def better(new: TrainedPredictor, old: TrainedPredictor, k: str) -> bool:
        if new.meets(recall_target) != old.meets(recall_target):
            return new.meets(recall_target)
        if not old.meets(recall_target):
            return new.recall > old.recall
        return new.bytes_per_token(cost_base[k]) < old.bytes_per_token(cost_base[k])

    direction: dict[str, float] = {k: 2 for k in layers}  # 2: doubling; 0.5: halving; 0: settled

    def turn(k: str, current: TrainedPredictor) -> float:
        """After a doubling from the start that did not pay (or could not be tried), halve."""
        return 0.5 if direction[k] == 2 and current.rank == ranks[k] and current.meets(recall_target) else 0

    def can_pay(k: str, rank: int) -> bool:
        """Whether ``rank`` could beat the best so far, even if it predicted no false positive and
        missed as many active neurons as the target allows (below a recall of 1, a predictor may
        predict fewer neurons than are active)."""
        p = best[k]
        floor = predictor_bytes(rank, *dims[k]) + (recall_target - RECALL_SLACK) * p.true_density * cost_base[k]
        return not p.meets(recall_target) or floor < p.bytes_per_token(cost_base[k])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if expect:
            expect(len(ranks))
        best = _train_layers(layers, ranks, recall_target, seed, progress, workers)
        while True:
            jobs: dict[str, int] = {}
            for k in sorted(layers, key=lambda k: -best[k].bytes_per_token(cost_base[k])):
                while direction[k]:
                    rank = best[k].rank
                    nxt = int(rank * direction[k])
                    extra = predictor_params(nxt, *dims[k]) - predictor_params(rank, *dims[k])
                    if MIN_RANK <= nxt <= max_rank[k] and total + extra <= budget_params and can_pay(k, nxt):
                        jobs[k] = nxt
                        total += max(extra, 0)  # reserved; released below when the rank does not pay
                        break
                    direction[k] = turn(k, best[k])
            if not jobs:
                return best
            if expect:
                expect(len(jobs))
            for k, p in _train_layers(layers, jobs, recall_target, seed, progress, workers).items():
                old = best[k]
                extra = predictor_params(p.rank, *dims[k]) - predictor_params(old.rank, *dims[k])
                if better(p, old, k):
                    best[k] = p
                    total += min(extra, 0)
                    continue
                total -= max(extra, 0)
                direction[k] = turn(k, old)
    finally:
        torch.set_num_threads(threads)


def _max_ranks(dims: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Per layer (``dims``: hidden and n_ff), the largest rank the search tries: half the smaller side."""
    return {k: max(1, min(hidden_nff) // 2) for k, hidden_nff in dims.items()}


def first_ranks(dims: dict[str, tuple[int, int]], start: dict[str, int], budget_params: int) -> dict[str, int]:
    """The ranks :func:`train_all` trains first: per layer (``dims``: hidden and n_ff), its
    ``start`` rank within ``[MIN_RANK, half the smaller side]``, the largest predictors halved
    until all fit ``budget_params``. Raises ValueError when even the smallest ranks do not fit."""
    max_rank = _max_ranks(dims)
    ranks = {k: min(max(start[k], MIN_RANK), max_rank[k]) for k in dims}
    total = sum(predictor_params(ranks[k], *dims[k]) for k in dims)
    while total > budget_params:
        k = max(dims, key=lambda k: predictor_params(ranks[k], *dims[k]))
        if ranks[k] // 2 < min(MIN_RANK, start[k]):
            raise ValueError(f"even the smallest predictors need {total} parameters, over the budget of "
                             f"{budget_params}; raise the predictor budget")
        total -= predictor_params(ranks[k], *dims[k]) - predictor_params(ranks[k] // 2, *dims[k])
        ranks[k] //= 2
    return ranks


def _train_layers(layers: dict[str, LayerData], jobs: dict[str, int], recall_target: float, seed: int,
                  progress: Callable[[str], None] | None, workers: int) -> dict[str, TrainedPredictor]:
    """Train a predictor of rank ``jobs[k]`` for each layer ``k`` in ``jobs``, ``workers`` layers
    at once, calling ``progress(k)`` as each one finishes."""

    def one(k: str) -> tuple[str, TrainedPredictor]:
        p = train_predictor(layers[k], jobs[k], recall_target, seed)
        if progress:
            progress(k)
        return k, p

    if workers <= 1 or len(jobs) <= 1:
        return dict(map(one, jobs))
    with ThreadPoolExecutor(min(workers, len(jobs))) as pool:
        return dict(pool.map(one, jobs))
