"""Running pipelines: parsing ``-p`` specs, verifying after every pass, dumps and timings."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from picc.errors import PiccError
from picc.fsutil import write_text_atomic
from picc.ir.module import Module
from picc.ir.printer import print_module
from picc.ir.verifier import VerifyError, verify
from picc.ir.weights import WeightStore
from picc.passes.options import PassOptions, format_options, parse_options
from picc.passes.registry import PASSES, PassContext, PassInfo, PipelineArtifacts

if TYPE_CHECKING:
    from picc.frontend.tokenizer import Tokenizer


def pass_info(name: str) -> PassInfo:
    """The registered pass ``name``, or a PiccError listing the registered ones."""
    info = PASSES.get(name)
    if info is None:
        raise PiccError(f"pipeline: unknown pass {name!r}; registered passes: {', '.join(sorted(PASSES))}")
    return info


@dataclass(frozen=True)
class PassSpec:
    """One entry of a pipeline: a registered pass name and its options (the pass's own options
    dataclass; left out, its defaults). ``str(spec)`` is the pipeline text that parses back to it."""

    name: str
    options: PassOptions = field(default_factory=PassOptions)

    def __post_init__(self) -> None:
        cls = pass_info(self.name).options
        if type(self.options) is PassOptions and cls is not PassOptions:
            object.__setattr__(self, "options", cls())
        elif type(self.options) is not cls:
            raise PiccError(f"pass {self.name!r} takes {cls.__name__}, not {type(self.options).__name__}")

    def __str__(self) -> str:
        text = format_options(self.options)
        return f"{self.name}{{{text}}}" if text else self.name


_NAME = re.compile(r"\s*([\w-]+)\s*")


def parse_pipeline(text: str) -> list[PassSpec]:
    """Parse ``"profile-activations{tokens=4096},insert-predictors"`` into pass specs, each pass's
    options into its options dataclass."""
    specs: list[PassSpec] = []
    pos = 0

    def fail(at: int, expected: str) -> PiccError:
        return PiccError(f"pipeline {text!r}: at character {at + 1}: expected {expected}")

    while pos < len(text):
        m = _NAME.match(text, pos)
        if not m:
            raise fail(pos, "a pass name")
        name, pos = m.group(1), m.end()
        info = pass_info(name)
        items: list[str] = []
        if text.startswith("{", pos):
            close = text.find("}", pos)
            if close < 0 or "{" in text[pos + 1 : close]:
                raise fail(pos, "options as {key=value,...} closed by '}'")
            items = [s for s in (s.strip() for s in text[pos + 1 : close].split(",")) if s]
            pos = close + 1
        specs.append(PassSpec(name, parse_options(info.options, name, items)))
        rest = text[pos:].lstrip()
        if rest and not rest.startswith(","):
            raise fail(len(text) - len(rest), "',' between passes")
        pos = len(text) - len(rest) + 1
    if not specs:
        raise PiccError("pipeline: expected at least one pass")
    return specs


@dataclass
class Instruments:
    """What to observe while a pipeline runs (the command line's --print-after... flags)."""

    verify: bool = True
    print_after_all: bool = False
    print_after: frozenset[str] = frozenset()
    dump_dir: Path | None = None
    time_passes: bool = False
    out: TextIO = field(default_factory=lambda: sys.stdout)
    timings: list[tuple[str, float]] = field(default_factory=list)
    on_pass: Callable[[str, Module], None] | None = None


def run_pipeline(module: Module, weights: WeightStore, pipeline: list[PassSpec],
                 instruments: Instruments | None = None, tokenizer: Tokenizer | None = None) -> Module:
    """Run ``pipeline`` on ``module``; errors name the pass and the passes that ran before it."""
    inst = instruments or Instruments()
    if inst.dump_dir is not None:
        inst.dump_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(inst.dump_dir / "00_input.picc", print_module(module))
    done: list[str] = []
    artifacts = PipelineArtifacts()
    for index, spec in enumerate(pipeline, 1):
        info = PASSES[spec.name]
        before = f" (after: {', '.join(done)})" if done else " (first pass)"
        start = time.perf_counter()
        try:
            module = info.fn(module, PassContext(weights, spec.options, tokenizer, artifacts))
        except PiccError as e:
            raise PiccError(f"pass '{spec.name}' failed{before}: {e}") from None
        except Exception as e:
            raise PiccError(f"pass '{spec.name}' crashed{before}: {type(e).__name__}: {e}") from e
        elapsed = time.perf_counter() - start
        if inst.verify:
            try:
                verify(module)
            except VerifyError as e:
                raise PiccError(f"pass '{spec.name}' produced invalid IR{before}: {e}") from None
        inst.timings.append((spec.name, elapsed))
        done.append(spec.name)
        if inst.print_after_all or spec.name in inst.print_after:
            inst.out.write(f"// ----- IR after {spec} -----\n{print_module(module)}")
        if inst.dump_dir is not None:
            path = inst.dump_dir / f"{index:02d}_{spec.name}.picc"
            write_text_atomic(path, print_module(module))
        if inst.on_pass:
            inst.on_pass(spec.name, module)
    if inst.time_passes:
        total = sum(t for _, t in inst.timings) or 1e-12
        inst.out.write("pass                     seconds   share\n")
        for name, t in inst.timings:
            inst.out.write(f"{name:<24} {t:8.3f} {100 * t / total:6.1f}%\n")
    return module
