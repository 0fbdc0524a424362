"""The pass registry: every pass is a named pure function ``(Module, PassContext) -> Module``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from picc.ir.module import Module
from picc.ir.weights import WeightStore
from picc.passes.options import PassOptions

if TYPE_CHECKING:
    from picc.frontend.tokenizer import Tokenizer
    from picc.sparsity.predictors import LayerData

OptionsT = TypeVar("OptionsT", bound=PassOptions)


@dataclass(frozen=True)
class FfnInputs:
    """The inputs and active neurons (score > 0) of ReLU ffn ops over calibration windows
    (``calib``, ``tokens``, ``window``, ``seed`` as ``picc.sparsity.calib.token_windows`` takes
    them), by ffn name."""

    calib: str
    tokens: int
    window: int
    seed: int
    layers: dict[str, LayerData]


@dataclass
class PipelineArtifacts:
    """What a pass computed that a later pass of the same pipeline run may use instead of
    computing it again; too big for the module (and not part of the computation it describes).
    A pass run on its own finds it empty."""

    ffn_inputs: FfnInputs | None = None  # profile-activations' forward (keep-inputs), for insert-predictors


@dataclass(frozen=True)
class PassContext(Generic[OptionsT]):
    """What a pass may use besides the module: the weight store, its options, the tokenizer,
    and the pipeline run's artifacts.

    The options are the pass's own dataclass (``PassContext[ProfileOptions]``), parsed and
    checked before the pass runs. The store is append-only, so a pass that changes a weight adds
    it under a new name and the module it was given stays valid.
    """

    weights: WeightStore
    options: OptionsT = field(default_factory=PassOptions)  # type: ignore[assignment]
    tokenizer: Tokenizer | None = None
    artifacts: PipelineArtifacts = field(default_factory=PipelineArtifacts)


PassFn = Callable[[Module, PassContext[Any]], Module]


@dataclass(frozen=True)
class PassInfo:
    """A registered pass: its name, function, one-line summary and options dataclass."""

    name: str
    fn: PassFn
    summary: str
    options: type[PassOptions]


PASSES: dict[str, PassInfo] = {}


def register_pass(name: str, options: type[PassOptions] = PassOptions) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as pass ``name`` taking ``options``; its docstring's first line
    is its summary."""

    def wrap(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise ValueError(f"pass {name!r} is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        PASSES[name] = PassInfo(name, fn, summary, options)
        return fn

    return wrap
