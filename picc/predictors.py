"""Training activation predictors: one low-rank MLP per FFN layer (hidden -> r -> n_ff).

PowerInfer's predictor training code was never released; this is picc's. A predictor sees the
FFN's input and guesses which neurons will be active under the profiling rule (activity score >
the layer's threshold). Its decision threshold favours recall: a missed active neuron costs
accuracy, an extra one only time.

Calibration tokens are split, for a seed, into train (80%), threshold (10%) and test (10%). A
layer's predictor is *good enough* when, on the test tokens, it reaches the recall target (minus
``RECALL_SLACK`` for the held-out gap) while predicting at most half of the neurons the FFN
could skip as active. Ranks start small for sparse, skewed layers and double until good enough
or until the budget for all predictors is spent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

RECALL_SLACK = 0.01
MAX_STEPS = 600
BATCH = 256


@dataclass(frozen=True)
class LayerData:
    """Calibration tokens of one FFN layer: its inputs and which neurons were active."""

    x: np.ndarray  # [tokens, hidden] float32
    active: np.ndarray  # [tokens, n_ff] bool

    @property
    def density(self) -> float:
        return float(self.active.mean())


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

    def good_enough(self, recall_target: float) -> bool:
        skippable = 1.0 - self.true_density
        return (self.recall >= recall_target - RECALL_SLACK
                and self.predicted_density <= self.true_density + 0.5 * skippable)


def predictor_params(rank: int, hidden: int, n_ff: int) -> int:
    return rank * (hidden + 1) + n_ff * (rank + 1)


def starting_rank(hidden: int, n_ff: int, sparsity: float, top20: float) -> int:
    """A first guess: proportional to the layer's density, halved when a few neurons dominate."""
    guess = min(hidden, n_ff) * max(1.0 - sparsity, 0.05) / 2
    if top20 > 0.5:
        guess /= 2
    return int(2 ** max(4, math.floor(math.log2(max(guess, 1)))))


def logits(p: TrainedPredictor, x: np.ndarray) -> np.ndarray:
    h = np.maximum(x @ p.fc1.T + p.fc1_bias, np.float32(0))
    return h @ p.fc2.T + p.fc2_bias


def split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    a, b = int(0.8 * n), int(0.9 * n)
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
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, rank), torch.nn.ReLU(), torch.nn.Linear(rank, n_ff))
    density = max(float(y[train].mean()), 1e-3)
    # Weight positives up (capped) so the loss, like the decision, cares more about misses.
    pos_weight = torch.tensor(min(8.0, max(1.0, (1 - density) / density)))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    steps = min(MAX_STEPS, max(200, 30 * len(train) // BATCH))
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
              seed: int, progress: Callable[[str], None] | None = None) -> dict[str, TrainedPredictor]:
    """Train every layer's predictor, doubling the ranks of layers that are not good enough while
    the total parameter count stays within ``budget_params``."""
    dims = {k: (d.x.shape[1], d.active.shape[1]) for k, d in layers.items()}
    ranks = {k: min(start[k], min(dims[k]) // 2) for k in layers}
    total = sum(predictor_params(ranks[k], *dims[k]) for k in layers)
    if total > budget_params:
        raise ValueError(f"even the starting predictors need {total} parameters, over the budget of "
                         f"{budget_params}; raise the predictor budget")
    trained: dict[str, TrainedPredictor] = {}
    pending = list(layers)
    while pending:
        for k in pending:
            trained[k] = train_predictor(layers[k], ranks[k], recall_target, seed)
            if progress:
                progress(k)
        pending = []
        for k in sorted(layers, key=lambda k: trained[k].recall):
            if trained[k].good_enough(recall_target):
                continue
            bigger = ranks[k] * 2
            extra = predictor_params(bigger, *dims[k]) - predictor_params(ranks[k], *dims[k])
            if bigger < min(dims[k]) and total + extra <= budget_params:
                ranks[k], total = bigger, total + extra
                pending.append(k)
    return trained
