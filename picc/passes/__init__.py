"""Passes over the picc IR. Importing this package registers every pass."""

from picc.passes import (  # noqa: F401 - registration
    canonicalize,
    dce,
    fuse_gather_gemv,
    insert_predictors,
    neuron_major_down,
    partition_neurons,
    profile_activations,
    select_kernels,
)
from picc.passes.manager import Instruments, PassSpec, parse_pipeline, run_pipeline
from picc.passes.registry import PASSES, PassContext, register_pass

__all__ = ["PASSES", "Instruments", "PassContext", "PassSpec", "parse_pipeline",
           "register_pass", "run_pipeline"]
