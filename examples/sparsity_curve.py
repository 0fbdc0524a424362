"""The accuracy cost of each sparsity mode across target sparsities, on PTB valid.

    .venv/bin/python examples/sparsity_curve.py smollm2 --tokens 16384 > curve.md

Profiles the model once on PTB train (4096 tokens; thresholds by --rule, fisher by default: see
picc.sparsity.profiling), then for every mode and target in 20-70% makes the FFNs sparse and measures
perplexity, the increase over dense and the top-1 agreement with dense on the first --tokens
tokens of PTB valid. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time

from picc.frontend import load_model
from picc.ir.weights import WeightStore
from picc.passes import PassSpec, run_pipeline
from picc.passes.insert_predictors import InsertOptions
from picc.sparsity import FISHER_TOKENS
from picc.sparsity.calib import token_windows
from picc.sparsity.evaluation import dense_reference, eval_windows, evaluate
from picc.sparsity.profiling import THRESHOLD_RULES, attach, calibrate

TARGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--tokens", type=int, default=16384, help="PTB-valid tokens to evaluate")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--modes", default="gate-first,down-only")
    parser.add_argument("--rule", default="fisher", choices=THRESHOLD_RULES, help="how thresholds are calibrated")
    parser.add_argument("--fisher-tokens", type=int, default=FISHER_TOKENS,
                        help=f"calibration tokens the Fisher scales' gradients are taken on (default {FISHER_TOKENS})")
    args = parser.parse_args()

    start = time.perf_counter()
    model = load_model(args.model)
    calib = token_windows(model.tokenizer, "ptb", 4096, 256, seed=0)
    profiles = calibrate(model.module, model.weights, calib, TARGETS, args.rule, fisher_tokens=args.fisher_tokens)
    windows = eval_windows(model.tokenizer, "ptb-valid", args.tokens, args.window)
    reference = dense_reference(model.module, model.weights, windows)
    print(f"{args.model}: PTB valid, {sum(len(w) - 1 for w in windows)} predicted tokens, windows of "
          f"{args.window}; thresholds calibrated on 4096 tokens of PTB train, rule {args.rule}\n")
    print("| mode | target | measured sparsity | ppl | dense ppl | increase | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for target, profile in zip(TARGETS, profiles, strict=True):
            store = WeightStore({n: model.weights[n] for n in model.weights})
            insert = PassSpec("insert-predictors", InsertOptions(mode=mode))
            module = run_pipeline(attach(model.module, store, profile), store, [insert], tokenizer=model.tokenizer)
            r = evaluate(module, store, windows, reference=reference)
            print(f"| {mode} | {target:.1f} | {r.ffn_sparsity:.3f} | {r.ppl:.3f} | {r.ppl_dense:.3f} | "
                  f"{100 * r.ppl_increase:+.2f}% | {r.top1_agreement:.4f} |", flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
