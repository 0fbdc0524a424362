"""Timing a model's sparse and dense builds against each other on this machine.

The cost model prices a sparse FFN's active rows at the rate the target's kernels read gathered
rows of a probe's shape (rows of 1024); a model's own rows can read slower (SmolLM2's rows of 576
on a 2-core Zen 5: its sparse build estimated ~404 tokens/s against ~393 dense, and decoded 388
against 456). Where the target is the machine the compile runs on, ``picc compile`` settles a
choice the estimates make for sparsity by decoding with both builds: a few steps each, the two
alternating round by round (a slow phase of a shared machine then slows both), the median
step of each. Sparsity costs accuracy, so the sparse build must be :data:`MARGIN` faster to be
kept. Builds too large to hold twice in memory, or to time quickly, keep the estimates' choice.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from picc.compile import Compiled, CompileOptions
    from picc.frontend.model import LoadedModel
    from picc.passes import Instruments

MARGIN = 0.03
"""How much faster (a share) the sparse build must decode to be chosen over the dense one."""
ROUNDS = 5  # rounds, each a run of every build in turn
STEPS = 48  # decode steps a run
MAX_BYTES = 2**30
"""The most weight bytes a build the trial loads may have (two at once): past it, the estimates decide."""
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids every vocabulary has


def decode_rates(builds: Sequence[Compiled], say: Callable[[str], None] | None = None) -> list[float] | None:
    """Each build's decode tokens/s on this machine (medians of :data:`ROUNDS` alternating runs of
    :data:`STEPS` greedy steps, all the cores this process may use), or None where a build's
    weights are past :data:`MAX_BYTES`. The files are written to a temporary folder, removed after."""
    from picc.compile import write_compiled
    from picc.placement.cost_model import weight_bytes
    from runtime.session import Session

    weights = [sum(weight_bytes(b.model.weights, name) for name in b.model.weights) for b in builds]
    if max(weights) > MAX_BYTES:
        return None
    with tempfile.TemporaryDirectory(prefix="picc-trial-") as folder:
        paths = [Path(folder) / f"build{i}.pib" for i in range(len(builds))]
        for build, path in zip(builds, paths, strict=True):
            write_compiled(build, path)
        if say is not None:
            say(f"timing {len(builds)} builds on this CPU ({ROUNDS} rounds of {STEPS} decode steps each)")
        sessions = [Session(path, threads=None) for path in paths]
        try:
            seconds: list[list[float]] = [[] for _ in sessions]
            for _ in range(ROUNDS + 1):  # the first round warms caches and pages up
                for s, taken in zip(sessions, seconds, strict=True):
                    s.reset()
                    s.feed(PROMPT)
                    start = time.perf_counter()
                    s.greedy_tokens(STEPS + 1)
                    taken.append((time.perf_counter() - start) / STEPS)
            return [1.0 / statistics.median(taken[1:]) for taken in seconds]
        finally:
            for s in sessions:
                s.close()


def faster_on_this_cpu(model: LoadedModel, options: CompileOptions, sparse: Compiled,
                       instruments: Instruments | None, say: Callable[[str], None]) -> Compiled:
    """``sparse``, or the dense build, whichever decodes faster on this machine
    (:func:`decode_rates`): the estimates chose sparsity, and the target is this CPU."""
    from picc.compile import compile_model

    dense = compile_model(model, replace(options, dense=True), instruments, lambda _: None)
    rates = decode_rates([sparse, dense], say)
    if rates is None:
        return sparse
    s, d = rates
    sparse.report.update(sparse_measured_tokens_per_s=s, dense_measured_tokens_per_s=d)
    timed = f"decoding here at ~{s:.0f} tokens/s sparse, ~{d:.0f} dense"
    if s >= (1 + MARGIN) * d:
        say(f"keeping the sparse model: {timed}")
        sparse.report["notes"].append(f"sparse, chosen by timing both builds: {timed}")
        return sparse
    say(f"compiling the dense model: {timed} (the cost model estimated ~{sparse.report['estimate_tokens_per_s']:.0f} "
        f"sparse; --sparse keeps sparsity)")
    dense.report["notes"].append(f"dense, chosen by timing both builds: {timed}")
    dense.report.update(sparse_measured_tokens_per_s=s, dense_measured_tokens_per_s=d,
                        sparse_estimate_tokens_per_s=sparse.report["estimate_tokens_per_s"])
    return dense
