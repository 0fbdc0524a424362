"""The placement minimising the cost model's FFN time: a MILP (scipy's HiGHS), then refinement.

Each layer's sorted neurons form blocks; a continuous variable per block says how much of it is
on the GPU (blocks fill in order), two binaries per layer say whether any / all of it is (the
sync cost; with end blocks of ``min_split`` neurons they also enforce the minimum split), and
``t_l`` is at least each device's time (:mod:`picc.placement.partition.problem` has the cost model). The
MILP decides each layer's state (CPU, split, GPU); :func:`_refine` then places the neurons of the
split layers one by one. The answer of :func:`solve_ilp` is the best, by the exact estimate, of:
that, the MILP's own counts, greedy's states refined the same way, and greedy's own placement.
So it is never worse than greedy (:mod:`picc.placement.partition.greedy`) when greedy respects
``min_split``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from picc.placement.partition.greedy import greedy_counts
from picc.placement.partition.problem import PartitionProblem, Placement, estimate_counts, make_placement, sorted_rates

# Enough blocks for the MILP to choose each layer's state well (a 70B model's 80 x 28672
# neurons become blocks of 1120), few enough for HiGHS to solve that in about a second.
MAX_BLOCKS = 2048
# Up to this many neurons in all, every block is one neuron with an integer variable, so the
# MILP is exact (the tests compare it with brute force); beyond, integer blocks cost seconds.
EXACT_MAX_NEURONS = 256
# The MILP's relative optimality gap: 0.1% of the FFN time, below one sync on big models.
MIP_GAP = 1e-3


def _block_sizes(n: int, m: int, block: int) -> list[int]:
    """A layer's sorted neurons in blocks. With ``min_split`` m, the first and last blocks hold
    m neurons each, so "some but not all on the GPU" already means >= m on each side."""
    if m > 0 and n < 2 * m:
        return [n]  # too small to split: all or nothing
    middle = n - 2 * m if m > 0 else n
    chunks = [block] * (middle // block) + ([middle % block] if middle % block else [])
    return [m, *chunks, m] if m > 0 else chunks


@dataclass(frozen=True, slots=True, eq=False)
class _MilpAnswer:
    any_gpu: np.ndarray  # [layers] bool: some of the layer's neurons on the GPU
    all_gpu: np.ndarray  # [layers] bool: all of them
    hot: list[int]  # the MILP's own counts (exact when its blocks are single neurons)
    status: str


class _Rows:
    """A sparse constraint matrix built a few rows at a time."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, cols: np.ndarray | list[int], vals: np.ndarray | list[float], lo: float, hi: float) -> None:
        """One row: ``lo <= sum(vals * x[cols]) <= hi``."""
        self.rows.append(np.full(len(cols), len(self.lower)))
        self.cols.append(np.asarray(cols))
        self.vals.append(np.asarray(vals, dtype=np.float64))
        self.lower.append(lo)
        self.upper.append(hi)

    def add_pairs(self, first: np.ndarray, second: np.ndarray, lo: float, hi: float) -> None:
        """Rows ``lo <= x[first[i]] - x[second[i]] <= hi``."""
        n = len(first)
        self.rows.append(np.repeat(np.arange(len(self.lower), len(self.lower) + n), 2))
        self.cols.append(np.stack([first, second], 1).ravel())
        self.vals.append(np.tile([1.0, -1.0], n))
        self.lower += [lo] * n
        self.upper += [hi] * n

    def constraint(self, n_var: int) -> LinearConstraint:
        a = sp.csr_matrix((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                          shape=(len(self.lower), n_var))
        return LinearConstraint(a, np.array(self.lower), np.array(self.upper))


def _milp(problem: PartitionProblem, ordered: list[np.ndarray], block: int, time_limit: float) -> _MilpAnswer | None:
    """Per layer: does the MILP put any of its neurons on the GPU, all of them, how many?

    Variables: per block the share on the GPU, per layer the binaries ``any`` and ``all`` and
    its time ``t``. None if HiGHS finds no solution.
    """
    layers, costs, m = problem.layers, problem.costs, problem.min_split
    n_layers = len(layers)
    sizes = [np.array(_block_sizes(la.n_ff, m, block), dtype=np.int64) for la in layers]
    starts = np.concatenate([[0], np.cumsum([len(s) for s in sizes])]).astype(np.int64)
    n_x = int(starts[-1])
    any_, all_, t = n_x, n_x + n_layers, n_x + 2 * n_layers
    n_var = n_x + 3 * n_layers
    exact = block == 1 and n_x <= EXACT_MAX_NEURONS
    # Times in units of a layer's average all-CPU time, so that HiGHS's absolute tolerances
    # mean the same for a test's made-up machine and for a 70B model on a 4090.
    all_cpu = sum(la.neuron_bytes * float(f.sum()) for la, f in zip(layers, ordered, strict=True)) / costs.cpu_bandwidth
    unit = n_layers / all_cpu if all_cpu > 0 else 1.0 / max(costs.sync_time, 1e-12)
    sync = costs.sync_time * unit

    objective = np.zeros(n_var)
    objective[t:] = 1.0
    rows = _Rows()
    # The budget, less a margin for HiGHS's tolerances (1e-6 on integrality, 1e-7 on rows) so
    # that the integer parts of the answer never overshoot by a byte.
    budget_coef = np.concatenate([s * la.neuron_bytes / problem.budget for s, la in zip(sizes, layers, strict=True)])
    rows.add(np.arange(n_x), budget_coef, -np.inf, 1.0 - int(2e-6 * problem.budget) / problem.budget)
    for i, (layer, f, s) in enumerate(zip(layers, ordered, sizes, strict=True)):
        x = np.arange(starts[i], starts[i + 1])
        if layer.input_on_gpu:
            objective[all_ + i] = -sync  # the constant sync of the other states is left out
        else:
            objective[any_ + i] = sync
        mass = np.add.reduceat(f, np.concatenate([[0], np.cumsum(s)[:-1]]))
        gpu = unit * layer.neuron_bytes * mass / costs.gpu_bandwidth
        cpu = unit * layer.neuron_bytes * mass / costs.cpu_bandwidth
        # t >= gpu time + (1 - any) * all-CPU time and t >= cpu time + all * all-GPU time. The
        # extra terms vanish in integer solutions; they make each layer's relaxation the convex
        # hull of its three states. Without them half a layer "all on the GPU" and half "all on
        # the CPU" would look concurrent, and HiGHS would spend seconds closing that gap.
        rows.add([t + i, any_ + i, *x], [1.0, cpu.sum(), *-gpu], cpu.sum(), np.inf)
        rows.add([t + i, all_ + i, *x], [1.0, -gpu.sum(), *cpu], cpu.sum(), np.inf)
        # Blocks fill in order, any >= first block, last block >= all; with min_split the end
        # blocks are exactly any and all.
        edge = 0.0 if m > 0 else np.inf
        rows.add([x[0], any_ + i], [1.0, -1.0], -edge, 0.0)
        rows.add([x[-1], all_ + i], [1.0, -1.0], 0.0, edge)
        rows.add_pairs(x[:-1], x[1:], 0.0, np.inf)

    integrality = np.zeros(n_var)
    integrality[any_:t] = 1
    if exact:
        integrality[:n_x] = 1
    upper = np.ones(n_var)
    upper[t:] = np.inf
    for i, layer in enumerate(layers):
        if not layer.gpu_kernel:
            upper[starts[i] : starts[i + 1]] = 0
            upper[[any_ + i, all_ + i]] = 0
    result = milp(objective, constraints=rows.constraint(n_var), integrality=integrality,
                  bounds=Bounds(np.zeros(n_var), upper),
                  options={"time_limit": time_limit, "mip_rel_gap": 1e-6 if exact else MIP_GAP, "disp": False})
    if result.x is None:
        return None
    layer_of = np.repeat(np.arange(n_layers), [len(s) for s in sizes])
    filled = np.bincount(layer_of, weights=result.x[:n_x] * np.concatenate(sizes), minlength=n_layers)
    status = "optimal" if result.status == 0 else "stopped at the time limit"
    return _MilpAnswer(result.x[any_:all_] > 0.5, result.x[all_:t] > 0.5,
                       [int(k) for k in np.floor(filled + 1e-6)], status)


def _ranges(problem: PartitionProblem, any_gpu: np.ndarray, all_gpu: np.ndarray) -> list[tuple[int, int]]:
    """The hot counts each layer may take in its state (CPU, split or GPU).

    A split layer takes ``[min_split, n - min_split]``. Without a minimum split, a layer stays
    at an end only where that end saves the sync; elsewhere any count costs the same sync.
    """
    m, no_sync = problem.min_split, problem.costs.sync_time == 0
    ranges = []
    for layer, some, every in zip(problem.layers, any_gpu, all_gpu, strict=True):
        n = layer.n_ff
        if not layer.gpu_kernel:
            ranges.append((0, 0))
            continue
        if some and not every:
            ranges.append((m, n - m))
            continue
        end = n if every else 0
        saves_sync = end == (n if layer.input_on_gpu else 0)
        ranges.append((end, end) if m > 0 or (saves_sync and not no_sync) else (0, n))
    return ranges


def _refine(problem: PartitionProblem, ordered: list[np.ndarray], ranges: list[tuple[int, int]]) -> list[int] | None:
    """The best hot counts within ``ranges`` under the budget, neuron by neuron (sync aside).

    Within a layer, time over the hot count falls while the CPU part is the slower one and rises
    after, and each neuron saves no more than the one before; so taking the best saving per
    byte over all layers, neuron by neuron, is optimal when all layers' neurons have the same
    size (and within a neuron of it otherwise). None if the ranges' minimums do not fit.
    """
    costs = problem.costs
    if any(lo > hi for lo, hi in ranges):
        return None  # a split of a layer too small to split
    pairs = list(zip(problem.layers, ranges, strict=True))
    remaining = problem.budget - sum(lo * la.neuron_bytes for la, (lo, _) in pairs)
    if remaining < 0:
        return None
    gains: list[np.ndarray] = []
    for (layer, (lo, hi)), f in zip(pairs, ordered, strict=True):
        b = layer.neuron_bytes
        cum = np.concatenate([[0.0], np.cumsum(f)])
        gpu = b * cum / costs.gpu_bandwidth
        cpu = b * (cum[-1] - cum) / costs.cpu_bandwidth
        best = lo + int(np.argmin(np.maximum(gpu, cpu)[lo : hi + 1]))
        k = np.arange(lo, best)
        # t(k) - t(k+1) while the CPU part is the slower; the first term is exact, not a difference.
        g = np.minimum.accumulate(np.minimum(b * f[k] / costs.cpu_bandwidth, cpu[k] - gpu[k + 1])) if k.size else k
        gains.append(g[: int(np.count_nonzero(g > 0))] / b)
    layer_of = np.repeat(np.arange(len(gains)), [g.size for g in gains])
    order = np.argsort(-np.concatenate(gains), kind="stable")  # ties: by layer, then in order
    sizes = np.array([la.neuron_bytes for la in problem.layers], dtype=np.int64)
    taken = int(np.searchsorted(np.cumsum(sizes[layer_of[order]]), remaining, side="right"))
    added = np.bincount(layer_of[order[:taken]], minlength=len(ranges))
    remaining -= int((added * sizes).sum())
    while True:  # smaller neurons of other layers may fit where the next in line did not
        fits = [(gains[i][added[i]], -i) for i in range(len(ranges))
                if added[i] < gains[i].size and sizes[i] <= remaining]
        if not fits:
            break
        i = -max(fits)[1]
        added[i] += 1
        remaining -= int(sizes[i])
    return [lo + int(a) for (lo, _), a in zip(ranges, added, strict=True)]


def _feasible(problem: PartitionProblem, hot: list[int]) -> bool:
    pairs = list(zip(problem.layers, hot, strict=True))
    return (sum(k * la.neuron_bytes for la, k in pairs) <= problem.budget
            and all(k == 0 or la.gpu_kernel for la, k in pairs)
            and all(k in (0, la.n_ff) or min(k, la.n_ff - k) >= problem.min_split for la, k in pairs))


def solve_ilp(problem: PartitionProblem, *, block_size: int | None = None, time_limit: float = 3.0) -> Placement:
    """The placement minimising the cost model's FFN time (see the module docstring).

    ``block_size`` (neurons per MILP block) defaults to the smallest that keeps the MILP within
    ``MAX_BLOCKS`` blocks. If HiGHS reaches ``time_limit`` seconds, its best solution so far is
    used (``detail`` says so); the answer is still never worse than greedy's.
    """
    perms, ordered = sorted_rates(problem)
    n_layers = len(problem.layers)
    if problem.budget == 0 or not problem.layers:
        return make_placement(problem, [0] * n_layers, "ilp", perms, "nothing fits")
    total = sum(la.n_ff for la in problem.layers)
    block = block_size or -(-total // MAX_BLOCKS)

    named: list[tuple[str, list[int] | None]] = []
    answer = _milp(problem, ordered, block, time_limit)
    if answer is not None:
        ranges = _ranges(problem, answer.any_gpu, answer.all_gpu)
        named.append(("MILP states, refined", _refine(problem, ordered, ranges)))
        named.append(("MILP", answer.hot))
    greedy_hot = np.array(greedy_counts(problem, ordered))
    n_ff = np.array([la.n_ff for la in problem.layers])
    ranges = _ranges(problem, greedy_hot > 0, greedy_hot == n_ff)
    named.append(("greedy's states, refined", _refine(problem, ordered, ranges)))
    named.append(("greedy", greedy_hot.tolist()))
    named.append(("all on the CPU", [0] * n_layers))
    feasible = [(name, hot) for name, hot in named if hot is not None and _feasible(problem, hot)]
    # The first of equals wins (equal up to rounding: sums over different neurons round
    # differently), so the answer does not flip between candidates as the budget changes.
    times = [estimate_counts(problem, ordered, hot).ffn_time for _, hot in feasible]
    best = next(i for i, time in enumerate(times) if time <= min(times) * (1 + 1e-12))
    milp_status = f"HiGHS {answer.status}" if answer is not None else "HiGHS found no solution"
    detail = f"{milp_status} on blocks of {block} neurons; best candidate: {feasible[best][0]}"
    return make_placement(problem, feasible[best][1], "ilp", perms, detail)

