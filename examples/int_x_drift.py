"""How far rounding x to int8 moves a compiled model's logits end to end, and which ops it comes from.

    .venv/bin/python examples/int_x_drift.py build/smollm2.pib [--runtime]

A matrix op that rounds x to integers per block (``x_format``) computes a step function of x: where
the runtime's float arithmetic and the interpreter's differ by an ulp before the rounding (they
sum in different orders), an element now and then lands on the other side of a rounding boundary,
a whole step apart (1/254 of its block's largest |x| for int8, 2^-16 for int16), and the layers
after it carry that on. This measures that drift without the runtime: the interpreter against
itself with ``--noise`` (relative, uniform, ~1 ulp) added to x before every rounding, for each
choice of which rows8 matrix ops round to int8 instead of int16 (the model's own ``x_format``s
otherwise), the largest drift of a few noise draws. ``--runtime`` also compares the runtime with
the interpreter on the ``.pib`` as it is compiled, which is what the emulation stands in for. The
number is ``rel_err`` as the tests take it: the largest |difference| of a prompt's logits over the
largest |logit|.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from picc.interpreter import Interpreter
from picc.ir import ops as O
from picc.ir.module import Module
from picc.pib import load_pib
from runtime.session import Session

PROMPTS = ["Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his",
           "The capital of France is Paris, which is also the largest city in the country. It is known for its",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]

# Which int16 rows8 matrix ops round to int8 instead, and for a dense FFN which of its inputs
# (x for up and gate, h for down).
VARIANTS = {
    "as compiled": lambda op: None,
    "int8 everywhere (--int8-dots)": lambda op: ("x", "h"),
    "int8 in the FFNs (x and h)": lambda op: ("x", "h") if isinstance(op, O.FFN) else None,
    "int8 in the FFNs' up and gate": lambda op: ("x",) if isinstance(op, O.FFN) else None,
    "int8 in the FFNs' down": lambda op: ("h",) if isinstance(op, O.FFN) else None,
    "int8 in q, k, v and o": lambda op: None if isinstance(op, O.FFN) else ("x",),
}


class NoisyInterpreter(Interpreter):
    """The interpreter with ``noise`` (relative) added to x before each rounding, and int8 for
    the inputs ``int8`` names per op result (``"x"``: what the op dots first, ``"h"``: a dense
    FFN's down input)."""

    def __init__(self, module: Module, weights, noise: float, int8: dict[str, tuple[str, ...]],  # noqa: ANN001
                 seed: int = 0) -> None:
        super().__init__(module, weights)
        self.noise, self.int8, self.rng = noise, int8, np.random.default_rng(seed)

    def dot_input(self, op: O.Op, weight: str, x: np.ndarray) -> np.ndarray:
        if not (isinstance(op, O.MatrixOp) and op.rounds_x):
            return super().dot_input(op, weight, x)
        which = "h" if isinstance(op, O.FFN) and weight == op.down else "x"
        if which in self.int8.get(op.result, ()):
            op = replace(op, x_format="i8")
        if self.noise:
            x = (x * (1 + self.noise * self.rng.uniform(-1, 1, x.shape))).astype(np.float32)
        return super().dot_input(op, weight, x)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pib", help="a compiled model (.pib) whose matrix ops round x")
    ap.add_argument("--tokens", type=int, default=24, help="tokens of each prompt (default 24)")
    ap.add_argument("--noise", type=float, default=1.2e-7,
                    help="relative noise added to x before each rounding (default 1.2e-7, ~1 ulp)")
    ap.add_argument("--draws", type=int, default=3,
                    help="noise draws per prompt; the largest drift is shown (default 3)")
    ap.add_argument("--runtime", action="store_true", help="also the runtime against the interpreter")
    args = ap.parse_args()
    pib = load_pib(args.pib)
    with Session(args.pib, 2) as s:
        if s.text is None:
            raise SystemExit(f"{args.pib}: has no tokenizer to encode the prompts")
        prompts = [s.text.encode(p)[: args.tokens] for p in PROMPTS]
    rows8 = [op for op in pib.module.ops() if isinstance(op, O.MatrixOp) and op.layout == "rows8" and op.rounds_x]
    if not rows8:
        raise SystemExit(f"{args.pib}: no matrix op rounds x (compiled with --float-dots?)")
    formats = sorted({op.x_format for op in rows8})
    print(f"{args.pib}: {len(rows8)} rows8 matrix ops rounding x to {', '.join(formats)}; "
          f"{len(prompts)} prompts of {args.tokens} tokens; noise {args.noise:g}")
    print(f"\n| which ops round to int8 | rel_err per prompt (the largest of {args.draws} draws) |\n|---|---|")
    seen: list[dict[str, tuple[str, ...]]] = []
    for name, pick in VARIANTS.items():
        int8 = {op.result: which for op in rows8 if op.x_format == "i16" and (which := pick(op))}
        if int8 in seen:  # already int8 where this variant would round to it
            continue
        seen.append(int8)
        errs = []
        for ids in prompts:
            clean = NoisyInterpreter(pib.module, pib.weights, 0.0, int8).run(ids)
            errs.append(max(rel_err(NoisyInterpreter(pib.module, pib.weights, args.noise, int8, seed).run(ids), clean)
                            for seed in range(args.draws)))
        print(f"| {name} | {' / '.join(f'{e:.1e}' for e in errs)} |")
    if args.runtime:
        errs = []
        for ids in prompts:
            with Session(args.pib, 2) as s:
                got = s.feed(list(ids), all_logits=True).copy()
            errs.append(rel_err(got, Interpreter(pib.module, pib.weights).run(ids)))
        print(f"| the runtime against the interpreter, as compiled | {' / '.join(f'{e:.1e}' for e in errs)} |")


if __name__ == "__main__":
    main()
