"""Where each op and neuron runs, what it costs, and how memory is laid out.

* :mod:`.partition` -- the neuron placement problem and its solvers (greedy, ILP), driven by the
  ``partition-neurons`` pass;
* :mod:`.cost_model` -- the CPU's read rates per kernel, which the placement and report use;
* :mod:`.memory_plan` -- the exact buffers of a placed module (never over the VRAM budget);
* :mod:`.schedule` -- the hybrid step's stages and the values that cross between devices;
* :mod:`.plan_report` -- the estimate ``picc compile`` and ``picc inspect`` print.
"""
