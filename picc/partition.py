"""Which FFN neurons live on the GPU: greedy top-k and an ILP over the cost model.

The input is a :class:`PartitionProblem`: per FFN layer the neurons' activation frequencies (from
profiling) and the bytes one neuron occupies on the GPU, the VRAM left for FFN neurons, and the
devices' costs. The output is a :class:`Placement`: per layer the permutation sorting its neurons
by frequency (descending, ties by index) and the number ``hot`` of them on the GPU, so each
layer's GPU neurons are the contiguous prefix ``perm[:hot]``.

The cost model (per token, per layer; :func:`estimate`). A neuron's bytes are read when it is
active, except the ``dense_share`` of them that its layer's sparsity mode reads on every token
(the gate row in gate-first mode, say), so each neuron has a read rate ``rate = dense_share +
(1 - dense_share) * freq`` (just ``freq`` with a predictor) and a device's part of a layer reads
``neuron_bytes * sum(rate of its neurons)`` bytes on average::

    gpu_time  = neuron_bytes * sum(rate[hot])  / gpu_bandwidth
    cpu_time  = neuron_bytes * sum(rate[cold]) / cpu_bandwidth
    sync_time = 2 * (transfer_latency + sync_bytes / pcie_bandwidth)   when the layer's neurons
                are not all on the device that holds its input (the input crosses PCIe and the
                partial sum comes back); else 0
    time      = max(gpu_time, cpu_time) + sync_time                    (the parts run concurrently)

The FFN time per token is the sum over layers; dense parts (attention, predictors) are the
caller's to add. Two consequences worth knowing: a neuron moved to the GPU saves ``rate /
cpu_bandwidth`` seconds per byte of VRAM whatever its size; and once a layer's GPU part is the
slower one, more GPU neurons make the layer slower, so without a sync cost the model keeps a
few cold neurons on the CPU even when everything fits.

Solvers:

- :func:`greedy`: PowerInfer's de-facto solver. All neurons of all layers are ranked by
  frequency per byte (plain frequency when all layers' neurons have the same size); the longest
  prefix of that ranking that fits the budget goes to the GPU. It is blind to the cost model and
  to ``min_split``. A larger budget only adds neurons, so each layer's GPU activation share can
  only grow with it.
- :func:`solve_ilp`: a MILP (scipy's HiGHS) on the cost model. Each layer's sorted neurons form
  blocks; a continuous variable per block says how much of it is on the GPU (blocks fill in
  order), two binaries per layer say whether any / all of it is (the sync cost; with end blocks
  of ``min_split`` neurons they also enforce the minimum split), and ``t_l`` is at least each
  device's time. The MILP decides each layer's state (CPU, split, GPU); :func:`_refine` then
  places the neurons of the split layers one by one. The answer is the best, by the exact
  estimate, of: that, the MILP's own counts, greedy's states refined the same way, and greedy's
  own placement. So it is never worse than greedy when greedy respects ``min_split``.

When must they agree? With no sync cost, ``min_split = 0`` and the same ``neuron_bytes`` in all
layers, the best placement is greedy's ranking with each layer cut where it stops gaining (its
GPU part becomes the slower one, or its next neuron never fires). So the two agree when greedy
leaves every layer with ``gpu_time <= cpu_time`` and puts no never-active neuron on the GPU.
With budget 0 both place nothing. With a budget that holds every neuron and every layer's input
on the GPU, the ILP puts everything on the GPU when in every layer the sync cost exceeds what
keeping some neurons on the CPU would save (``time(n) - min_k time(k)``), and so agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from picc.targets import Target

# Enough blocks for the MILP to choose each layer's state well (a 70B model's 80 x 28672
# neurons become blocks of 1120), few enough for HiGHS to solve that in about a second.
MAX_BLOCKS = 2048
# Up to this many neurons in all, every block is one neuron with an integer variable, so the
# MILP is exact (the tests compare it with brute force); beyond, integer blocks cost seconds.
EXACT_MAX_NEURONS = 256
# The MILP's relative optimality gap: 0.1% of the FFN time, below one sync on big models.
MIP_GAP = 1e-3


@dataclass(frozen=True, slots=True)
class DeviceCosts:
    """The cost model's device terms: bandwidths in bytes/s, latency in seconds.

    ``cpu_bandwidth`` is the rate the CPU reads FFN weights at: its memory's bandwidth, or less
    where its kernels' arithmetic cannot keep up (4-bit formats on small CPUs).

    ``sync_bytes`` is the activation vector a split layer sends each way (hidden * 4 for f32).
    Without a GPU, ``gpu_bandwidth`` and ``pcie_bandwidth`` are 0.
    """

    gpu_bandwidth: float
    cpu_bandwidth: float
    pcie_bandwidth: float
    sync_bytes: int
    transfer_latency: float = 10e-6

    @property
    def sync_time(self) -> float:
        """What a layer whose neurons are not all beside its input pays per token."""
        if self.pcie_bandwidth <= 0:
            return 0.0
        return 2 * (self.transfer_latency + self.sync_bytes / self.pcie_bandwidth)

    @staticmethod
    def for_target(target: Target, hidden: int, cpu_read_rate: float | None = None) -> DeviceCosts:
        """The costs of ``target``'s devices for a model of width ``hidden`` (f32 activations);
        ``cpu_read_rate``: the rate the CPU's kernels read FFN weights at, when the target knows
        it (default: the memory's bandwidth)."""
        gpu = target.gpu.mem_bandwidth if target.gpu is not None else 0.0
        cpu = target.cpu.mem_bandwidth if cpu_read_rate is None else cpu_read_rate
        return DeviceCosts(gpu, cpu, target.pcie_bandwidth, 4 * hidden, target.pcie_latency)


@dataclass(frozen=True, slots=True, eq=False)
class FfnLayer:
    """One FFN layer's neurons: ``freq[i]`` is the share of tokens on which neuron i is active.

    ``neuron_bytes`` is what one neuron occupies on the GPU (its up and gate rows and its down
    column in their storage dtype). ``dense_share`` is the part of those bytes read on every
    token whether the neuron is active or not: 0 with a predictor, the gate row's share in
    gate-first mode, up and gate in down-only mode, 1 for a dense FFN. ``input_on_gpu`` says
    where the layer's input is computed (False when the memory plan left this layer's attention
    on the CPU). ``gpu_kernel`` False: the GPU cannot compute this layer's FFN (its sparsity
    mode has no GPU kernel), so every solver leaves all its neurons on the CPU.
    """

    name: str
    freq: np.ndarray
    neuron_bytes: int
    input_on_gpu: bool = True
    dense_share: float = 0.0
    gpu_kernel: bool = True

    @property
    def n_ff(self) -> int:
        return int(self.freq.shape[0])

    def read_rate(self) -> np.ndarray:
        """Per neuron, the expected share of its bytes one token reads (float64)."""
        f = self.freq.astype(np.float64)
        return self.dense_share + (1.0 - self.dense_share) * f if self.dense_share else f


@dataclass(frozen=True, slots=True, eq=False)
class PartitionProblem:
    """FFN layers, the VRAM ``budget`` left for their neurons (bytes), the device costs, and
    ``min_split``: a layer with neurons on both devices has at least this many on each.

    Inconsistent problems raise ValueError: they are the caller's bug, not the user's.
    """

    layers: tuple[FfnLayer, ...]
    budget: int
    costs: DeviceCosts
    min_split: int = 0

    def __post_init__(self) -> None:
        for layer in self.layers:
            f = layer.freq
            if f.ndim != 1 or f.size == 0 or not np.all(np.isfinite(f)) or f.min() < 0:
                raise ValueError(f"layer {layer.name}: freq must be a non-empty 1-D array of finite values >= 0")
            if layer.neuron_bytes <= 0:
                raise ValueError(f"layer {layer.name}: neuron_bytes must be > 0, got {layer.neuron_bytes}")
            if not 0.0 <= layer.dense_share <= 1.0:
                raise ValueError(f"layer {layer.name}: dense_share must be in [0, 1], got {layer.dense_share}")
        if self.budget < 0 or self.min_split < 0:
            raise ValueError(f"budget ({self.budget}) and min_split ({self.min_split}) must be >= 0")
        c = self.costs
        if c.cpu_bandwidth <= 0:
            raise ValueError(f"cpu_bandwidth must be > 0, got {c.cpu_bandwidth}")
        if c.gpu_bandwidth <= 0 and (self.budget > 0 or any(la.input_on_gpu for la in self.layers)):
            raise ValueError("without a GPU (gpu_bandwidth 0) the budget must be 0 and no layer's input on the GPU")
        if c.gpu_bandwidth > 0 and c.pcie_bandwidth <= 0:
            raise ValueError("a GPU needs a pcie_bandwidth > 0")

    @property
    def total_bytes(self) -> int:
        """The bytes of all neurons of all layers: a budget this large holds everything."""
        return sum(la.n_ff * la.neuron_bytes for la in self.layers)


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer's estimated seconds per token."""

    gpu_time: float
    cpu_time: float
    sync_time: float

    @property
    def time(self) -> float:
        return max(self.gpu_time, self.cpu_time) + self.sync_time


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """The cost model's FFN time per token and its breakdown (seconds)."""

    layers: tuple[LayerCost, ...]

    @property
    def gpu_time(self) -> float:
        """Time the GPU spends on FFN neurons (it overlaps the CPU's)."""
        return sum(la.gpu_time for la in self.layers)

    @property
    def cpu_time(self) -> float:
        """Time the CPU spends on FFN neurons (it overlaps the GPU's)."""
        return sum(la.cpu_time for la in self.layers)

    @property
    def sync_time(self) -> float:
        return sum(la.sync_time for la in self.layers)

    @property
    def ffn_time(self) -> float:
        """The total: per layer the slower device, plus transfers."""
        return sum(la.time for la in self.layers)


@dataclass(frozen=True, slots=True, eq=False)
class LayerPlacement:
    """One layer's split: neurons ``perm[:hot]`` on the GPU, ``perm[hot:]`` on the CPU."""

    name: str
    hot: int
    perm: np.ndarray
    gpu_bytes: int
    cpu_bytes: int
    gpu_activation_share: float  # of the layer's activations, the share its GPU neurons serve


@dataclass(frozen=True, slots=True, eq=False)
class Placement:
    """A solver's answer and the cost model's estimate of it; ``detail`` says how it was found."""

    solver: str
    budget: int
    layers: tuple[LayerPlacement, ...]
    cost: CostEstimate
    detail: str = ""

    @property
    def hot(self) -> tuple[int, ...]:
        return tuple(la.hot for la in self.layers)

    @property
    def gpu_bytes(self) -> int:
        return sum(la.gpu_bytes for la in self.layers)

    @property
    def cpu_bytes(self) -> int:
        return sum(la.cpu_bytes for la in self.layers)

    def gpu_activation_share(self, problem: PartitionProblem) -> float:
        """Of all activations of all layers, the share the GPU serves."""
        pairs = zip(problem.layers, self.layers, strict=True)
        hot = sum(float(la.freq[p.perm[: p.hot]].sum(dtype=np.float64)) for la, p in pairs)
        total = sum(float(la.freq.sum(dtype=np.float64)) for la in problem.layers)
        return hot / total if total > 0 else 0.0


# --- the cost model --------------------------------------------------------------------------


def frequency_order(freq: np.ndarray) -> np.ndarray:
    """The permutation sorting neurons by frequency, descending, ties by index."""
    return np.argsort(-np.asarray(freq, dtype=np.float64), kind="stable")


def _costs(problem: PartitionProblem, ordered: list[np.ndarray], hot: list[int] | tuple[int, ...]) -> CostEstimate:
    """The estimate when layer l's first ``hot[l]`` neurons of ``ordered[l]`` (read rates, see
    ``FfnLayer.read_rate``, in placement order) are on the GPU."""
    c = problem.costs
    costs = []
    for layer, f, k in zip(problem.layers, ordered, hot, strict=True):
        gpu_time = layer.neuron_bytes * float(f[:k].sum()) / c.gpu_bandwidth if k else 0.0
        cpu_time = layer.neuron_bytes * float(f[k:].sum()) / c.cpu_bandwidth
        beside_input = k == layer.n_ff if layer.input_on_gpu else k == 0
        costs.append(LayerCost(gpu_time, cpu_time, 0.0 if beside_input else c.sync_time))
    return CostEstimate(tuple(costs))


def estimate(problem: PartitionProblem, placement: Placement) -> CostEstimate:
    """The cost model's time per token for any placement, neuron by neuron."""
    ordered = [la.read_rate()[p.perm] for la, p in zip(problem.layers, placement.layers, strict=True)]
    return _costs(problem, ordered, placement.hot)


def make_placement(problem: PartitionProblem, hot: list[int] | tuple[int, ...], solver: str,
                   perms: list[np.ndarray] | None = None, detail: str = "") -> Placement:
    """A placement of ``hot[l]`` neurons per layer: the most frequent, unless ``perms`` says."""
    if perms is None:
        perms = [frequency_order(la.freq) for la in problem.layers]
    hot = [int(k) for k in hot]
    ordered = [la.read_rate()[p] for la, p in zip(problem.layers, perms, strict=True)]
    layers = []
    for layer, perm, k in zip(problem.layers, perms, hot, strict=True):
        if not 0 <= k <= (layer.n_ff if layer.gpu_kernel else 0):
            raise ValueError(f"layer {layer.name}: {k} hot neurons of {layer.n_ff}"
                             + ("" if layer.gpu_kernel else " (it has no GPU kernel)"))
        f = layer.freq[perm].astype(np.float64)
        total = float(f.sum())
        share = float(f[:k].sum()) / total if total > 0 else 0.0
        layers.append(LayerPlacement(layer.name, k, perm, k * layer.neuron_bytes,
                                     (layer.n_ff - k) * layer.neuron_bytes, share))
    return Placement(solver, problem.budget, tuple(layers), _costs(problem, ordered, hot), detail)


def min_split_violations(problem: PartitionProblem, placement: Placement) -> list[str]:
    """Layers split with fewer than ``min_split`` neurons on a side (greedy ignores the rule)."""
    m = problem.min_split
    return [f"layer {p.name}: {p.hot} GPU / {la.n_ff - p.hot} CPU neurons, min_split {m}"
            for la, p in zip(problem.layers, placement.layers, strict=True)
            if 0 < p.hot < la.n_ff and min(p.hot, la.n_ff - p.hot) < m]


# --- greedy ----------------------------------------------------------------------------------


def _sorted(problem: PartitionProblem) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each layer's frequency order and its read rates in that order (float64)."""
    perms = [frequency_order(la.freq) for la in problem.layers]
    return perms, [la.read_rate()[p] for la, p in zip(problem.layers, perms, strict=True)]


def _greedy_hot(problem: PartitionProblem, ordered: list[np.ndarray]) -> list[int]:
    if not problem.layers:
        return []
    # Concatenated layer by layer, each in its own order: the stable sort breaks ties by layer,
    # then by the layer's order, so each layer's GPU neurons stay a prefix of its order.
    scores = np.concatenate([f / la.neuron_bytes for la, f in zip(problem.layers, ordered, strict=True)])
    layer_of = np.repeat(np.arange(len(problem.layers)), [la.n_ff for la in problem.layers])
    order = np.argsort(-scores, kind="stable")
    order = order[np.array([la.gpu_kernel for la in problem.layers])[layer_of[order]]]
    sizes = np.array([la.neuron_bytes for la in problem.layers], dtype=np.int64)[layer_of[order]]
    taken = int(np.searchsorted(np.cumsum(sizes), problem.budget, side="right"))
    return np.bincount(layer_of[order[:taken]], minlength=len(problem.layers)).tolist()


def greedy(problem: PartitionProblem) -> Placement:
    """The longest prefix of all neurons ranked by frequency per byte that fits the budget."""
    perms, ordered = _sorted(problem)
    return make_placement(problem, _greedy_hot(problem, ordered), "greedy", perms,
                          "top neurons of all layers by frequency per byte")


# --- the ILP ---------------------------------------------------------------------------------


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
    perms, ordered = _sorted(problem)
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
    greedy_hot = np.array(_greedy_hot(problem, ordered))
    n_ff = np.array([la.n_ff for la in problem.layers])
    ranges = _ranges(problem, greedy_hot > 0, greedy_hot == n_ff)
    named.append(("greedy's states, refined", _refine(problem, ordered, ranges)))
    named.append(("greedy", greedy_hot.tolist()))
    named.append(("all on the CPU", [0] * n_layers))
    feasible = [(name, hot) for name, hot in named if hot is not None and _feasible(problem, hot)]
    # The first of equals wins (equal up to rounding: sums over different neurons round
    # differently), so the answer does not flip between candidates as the budget changes.
    times = [_costs(problem, ordered, hot).ffn_time for _, hot in feasible]
    best = next(i for i, time in enumerate(times) if time <= min(times) * (1 + 1e-12))
    milp_status = f"HiGHS {answer.status}" if answer is not None else "HiGHS found no solution"
    detail = f"{milp_status} on blocks of {block} neurons; best candidate: {feasible[best][0]}"
    return make_placement(problem, feasible[best][1], "ilp", perms, detail)


SOLVERS: dict[str, Callable[[PartitionProblem], Placement]] = {"greedy": greedy, "ilp": solve_ilp}
