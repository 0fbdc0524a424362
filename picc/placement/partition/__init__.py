"""Which FFN neurons live on the GPU: the problem, its cost model, and two solvers.

- :mod:`picc.placement.partition.problem`: the input (:class:`~picc.placement.partition.problem.PartitionProblem`:
  per FFN layer the neurons' frequencies and bytes, the VRAM budget, the device costs), the
  answer (:class:`~picc.placement.partition.problem.Placement`) and the cost model that estimates any
  placement's FFN time per token.
- :mod:`picc.placement.partition.greedy`: PowerInfer's de-facto solver, the top neurons of all layers by
  frequency per byte that fit the budget.
- :mod:`picc.placement.partition.ilp`: a MILP on the cost model (scipy's HiGHS), refined neuron by neuron.

``SOLVERS`` names them for ``partition-neurons{solver=...}``.

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

from picc.placement.partition.greedy import greedy
from picc.placement.partition.ilp import solve_ilp
from picc.placement.partition.problem import PartitionProblem, Placement

SOLVERS: dict[str, Callable[[PartitionProblem], Placement]] = {"greedy": greedy, "ilp": solve_ilp}
