"""The neuron placement problem, its answer, and the cost model that scores any answer.

The input is a :class:`PartitionProblem`: per FFN layer the neurons' activation frequencies (from
profiling) and the bytes one neuron occupies on the GPU, the VRAM left for FFN neurons, and the
devices' costs. The output is a :class:`Placement`: per layer the permutation sorting its neurons
by frequency (descending, ties by index) and the number ``hot`` of them on the GPU, so each
layer's GPU neurons are the contiguous prefix ``perm[:hot]``. The solvers are in
:mod:`picc.placement.partition.greedy` and :mod:`picc.placement.partition.ilp`.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from picc.targets import DEFAULT_PCIE_LATENCY, Target


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
    transfer_latency: float = DEFAULT_PCIE_LATENCY

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


def sorted_rates(problem: PartitionProblem) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each layer's frequency order and its read rates in that order (float64)."""
    perms = [frequency_order(la.freq) for la in problem.layers]
    return perms, [la.read_rate()[p] for la, p in zip(problem.layers, perms, strict=True)]


def estimate_counts(problem: PartitionProblem, ordered: list[np.ndarray],
                    hot: list[int] | tuple[int, ...]) -> CostEstimate:
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
    return estimate_counts(problem, ordered, placement.hot)


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
    return Placement(solver, problem.budget, tuple(layers), estimate_counts(problem, ordered, hot), detail)


def min_split_violations(problem: PartitionProblem, placement: Placement) -> list[str]:
    """Layers split with fewer than ``min_split`` neurons on a side (greedy ignores the rule)."""
    m = problem.min_split
    return [f"layer {p.name}: {p.hot} GPU / {la.n_ff - p.hot} CPU neurons, min_split {m}"
            for la, p in zip(problem.layers, placement.layers, strict=True)
            if 0 < p.hot < la.n_ff and min(p.hot, la.n_ff - p.hot) < m]
