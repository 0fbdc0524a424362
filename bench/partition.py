"""Benchmark of the neuron placement solvers on a 70B-shaped problem.

    python bench/partition.py [--reps 5] [--layers 80] [--neurons 28672]

A LLaMA-70B-shaped FFN (80 layers of 28 672 neurons, q4_0: 8 192 hidden, so 3 rows of 8192 x
18/32 bytes per neuron) with synthetic power-law activation frequencies (a few hot neurons, a
long cold tail, layers of different skew, as profiling finds in ReLU models), on the pc-high
target. For VRAM budgets holding 10%, 50% and 90% of the FFN, it prints the median time of
greedy top-k and of the ILP over ``--reps`` runs, the estimated tokens/s of each placement, and
checks that every placement fits its budget. Issue 5 asks for under 5 s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from picc.placement.partition.greedy import greedy  # noqa: E402
from picc.placement.partition.ilp import solve_ilp  # noqa: E402
from picc.placement.partition.problem import DeviceCosts, FfnLayer, PartitionProblem, estimate  # noqa: E402
from picc.targets import load_target  # noqa: E402
from picc.targets.host import host_cores, host_cpu_name  # noqa: E402


def power_law_layers(n_layers: int, n_ff: int, neuron_bytes: int, seed: int = 0) -> tuple[FfnLayer, ...]:
    """Per layer, frequencies ``f_i ~ c / rank^alpha`` (shuffled), alpha between 0.6 and 1.4."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        alpha = rng.uniform(0.6, 1.4)
        freq = np.minimum(1.0, 0.9 / np.arange(1, n_ff + 1) ** alpha + rng.uniform(0, 0.002, n_ff))
        layers.append(FfnLayer(f"l{i}", rng.permutation(freq).astype(np.float32), neuron_bytes))
    return tuple(layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--neurons", type=int, default=28672)
    args = p.parse_args()
    hidden = 8192
    neuron_bytes = 3 * hidden * 18 // 32  # up, gate and down rows of q4_0
    layers = power_law_layers(args.layers, args.neurons, neuron_bytes)
    costs = DeviceCosts.for_target(load_target("pc-high"), hidden)
    total = sum(la.n_ff * la.neuron_bytes for la in layers)
    print(f"machine: {host_cpu_name()}, {host_cores()} core(s); {platform.system()} {platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"{args.layers} layers x {args.neurons} neurons, {total / 2**30:.1f} GiB of FFN weights, pc-high; "
          f"medians of {args.reps} runs\n")
    print(f"{'budget':>8} {'greedy s':>9} {'ILP s':>9} {'greedy FFN tok/s':>17} {'ILP FFN tok/s':>14}")
    for share in (0.1, 0.5, 0.9):
        problem = PartitionProblem(layers, int(share * total), costs)
        times: dict[str, list[float]] = {"greedy": [], "ilp": []}
        placements = {}
        for _ in range(args.reps):
            for name, solve in (("greedy", greedy), ("ilp", solve_ilp)):
                start = time.perf_counter()
                placements[name] = solve(problem)
                times[name].append(time.perf_counter() - start)
        for name, placement in placements.items():
            used = sum(hot * la.neuron_bytes for hot, la in zip(placement.hot, layers, strict=True))
            assert used <= problem.budget, f"{name} placed {used} bytes over the {problem.budget}-byte budget"
        rate = {name: 1.0 / estimate(problem, placement).ffn_time for name, placement in placements.items()}
        print(f"{share:>7.0%} {statistics.median(times['greedy']):9.3f} {statistics.median(times['ilp']):9.3f} "
              f"{rate['greedy']:17.2f} {rate['ilp']:14.2f}")


if __name__ == "__main__":
    main()
