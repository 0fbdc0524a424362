"""What the compiler's commands do: ``picc import``, ``opt``, ``logits``, ``generate``, ``profile``,
``sparsify``, ``eval``, ``compile`` and ``inspect``. Their flags are declared in ``picc.cli``; the
commands that run a compiled ``.pib`` (``run``, ``bench``) are in ``picc.cli_runtime``."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from picc.errors import PiccError


def _load(source: str):  # noqa: ANN202 - LoadedModel, imported lazily to keep --help fast
    """Load SOURCE (an alias, a directory, a .gguf, .onnx, .picc or .pib) with the frontend."""
    from picc.frontend import load_model

    return load_model(source)


def _parse_tokens(text: str) -> list[int]:
    """The comma-separated token ids of ``--tokens``; a ``PiccError`` when one is not an integer or none is given."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise PiccError(f"--tokens {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise PiccError("--tokens: expected at least one token id")
    return ids


def _encode(model, text: str, instead: str = "") -> list[int]:  # noqa: ANN001
    """``text`` as token ids of ``model``'s tokenizer; an error when the model has none (``instead``:
    what to pass instead, where the command has a way)."""
    if model.tokenizer is None:
        hint = f"; pass {instead} instead" if instead else ""
        raise PiccError(f"{model.source}: the model has no tokenizer{hint}")
    return model.tokenizer.encode(text)


def _picc_output(output: str) -> Path:
    """``-o FILE.picc`` of import, opt and sparsify, checked before any work: the name (what the
    other commands read as a .picc) and that it and FILE.picc.weights can be written."""
    from picc.frontend.picc_file import weights_path
    from picc.fsutil import writable

    if not output.endswith(".picc"):
        raise PiccError(f"-o {output}: expected a file name ending in .picc (beside it goes its .picc.weights)")
    path = writable(output)
    writable(weights_path(path))
    return path


def check_seed(seed: int) -> None:
    """``--seed``: numpy's generators take no negative seed."""
    if seed < 0:
        raise PiccError(f"--seed {seed}: expected an integer >= 0")


def _check_window(window: int) -> None:
    if window < 2:
        raise PiccError(f"--window {window}: expected at least 2 tokens (a window predicts its tokens after the first)")


def _within_context(model, window: int) -> int:  # noqa: ANN001 - a LoadedModel
    """``window``, cut to the model's trained context (with a note): past it, perplexity and
    activation statistics describe the model where it was never trained."""
    max_position = model.module.attr("max_position")
    if isinstance(max_position, int) and window > max_position:
        print(f"note: windows of {max_position} tokens, the model's context length", file=sys.stderr)
        return max_position
    return window


def _check_calibration_tokens(args: argparse.Namespace) -> None:
    for flag, n in (("--tokens", args.tokens), ("--fisher-tokens", args.fisher_tokens)):
        if n < 1:
            raise PiccError(f"{flag} {n}: expected at least 1")


def cmd_import(args: argparse.Namespace) -> None:
    """``picc import``: write SOURCE as IR text and its weights."""
    from picc.frontend.picc_file import save_picc

    out = _picc_output(args.output)
    model = _load(args.source)
    save_picc(model, out)
    n = len(model.module.weights)
    print(f"wrote {args.output} ({len(list(model.module.ops()))} ops, {n} weights in "
          f"{args.output}.weights)", file=sys.stderr)


def cmd_opt(args: argparse.Namespace) -> None:
    """``picc opt``: run the ``-p`` pipeline over a .picc file; save the result, or print its IR for ``-o -``."""
    from picc.frontend.picc_file import save_picc
    from picc.passes import parse_pipeline, run_pipeline

    pipeline = parse_pipeline(args.passes)
    unknown = sorted(set(args.print_after or ()) - {p.name for p in pipeline})
    if unknown:
        raise PiccError(f"--print-after {unknown[0]}: not a pass of this pipeline ({args.passes})")
    out = None if args.output == "-" else _picc_output(args.output)
    _check_dump_dir(args)
    model = _load(args.input)
    inst = _instruments(args, out=sys.stderr if out is None else sys.stdout)
    module = run_pipeline(model.module, model.weights, pipeline, inst, tokenizer=model.tokenizer)
    result = replace(model, module=module)
    if args.output == "-":
        from picc.ir.printer import print_module

        sys.stdout.write(print_module(module))
    else:
        save_picc(result, out)


def cmd_logits(args: argparse.Namespace) -> None:
    """``picc logits``: save every position's logits, run by the runtime for a .pib (unless
    ``--interpreter``), else by the reference interpreter."""
    from picc.fsutil import atomic_path, writable
    from picc.generate import check_token_ids
    from picc.interpreter import Interpreter

    out = writable(args.out)
    model = _load(args.source)
    ids = _parse_tokens(args.tokens) if args.tokens is not None else _encode(model, args.text, "--tokens")
    check_token_ids(ids, int(model.module.attr("vocab", 0) or 0) or max(ids) + 1)
    if str(args.source).endswith(".pib") and not args.interpreter:
        from picc.cli_runtime import logits_with_runtime

        logits = logits_with_runtime(args.source, ids, args.threads, args.gpu)
    else:
        logits = Interpreter(model.module, model.weights).run(ids).astype(np.float32)
    with atomic_path(out) as tmp:
        buf = io.BytesIO()
        np.save(buf, logits)
        tmp.write_bytes(buf.getvalue())
    print(f"wrote {out}: logits of shape {logits.shape}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    """``picc generate``: stream text decoded on the reference interpreter, or print it as JSON."""
    from picc.generate import generate_ids

    if args.n < 0:
        raise PiccError(f"-n {args.n}: expected a number of tokens >= 0")
    if not 0 <= args.temperature < float("inf"):
        raise PiccError(f"--temperature {args.temperature}: expected a finite value >= 0")
    check_seed(args.seed)
    model = _load(args.source)
    prompt = _encode(model, args.prompt)
    tok = model.tokenizer
    tokens: list[int] = []
    start = time.perf_counter()
    shown = ""
    if not args.json:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    for t in generate_ids(model, prompt, args.n, args.temperature, args.seed):
        tokens.append(t)
        if not args.json:
            text = tok.decode(tokens)
            # Print only the text that is final: a partial UTF-8 sequence decodes to U+FFFD.
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    elapsed = time.perf_counter() - start
    text = tok.decode(tokens)
    if args.json:
        print(json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": text}))
    else:
        sys.stdout.write(text[len(shown):] + "\n")
        rate = len(tokens) / elapsed if elapsed > 0 else float("inf")
        print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, {rate:.1f} tok/s on the "
              "reference interpreter]", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> None:
    """``picc profile``: calibrate and print (or save, or plot) per-layer FFN sparsity."""
    from picc.fsutil import writable
    from picc.sparsity import profiling
    from picc.sparsity.calib import check_source, token_windows

    _check_window(args.window)
    check_seed(args.seed)
    _check_calibration_tokens(args)
    check_source(args.calib)
    if not 0 <= args.target_sparsity < 1:
        raise PiccError(f"--target-sparsity {args.target_sparsity}: expected a value in [0, 1)")
    for output in (args.output, args.plot):
        if output:
            writable(output)
    model = _load(args.source)
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer, so calibration text cannot be read")
    windows = token_windows(model.tokenizer, args.calib, args.tokens, _within_context(model, args.window), args.seed)
    (profile,) = profiling.calibrate(model.module, model.weights, windows, [args.target_sparsity],
                                     args.threshold_rule, fisher_tokens=args.fisher_tokens)
    if args.output:
        profiling.save_npz(profile, Path(args.output))
    if args.plot:
        profiling.plot(profile, Path(args.plot))
    summary = profile.summary()
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{'ffn':<16} {'sparsity':>8} {'threshold':>10} {'top10%':>7} {'top20%':>7} {'top50%':>7}")
    for layer in summary["layers"]:  # type: ignore[union-attr]
        print(f"{layer['ffn']:<16} {layer['sparsity']:8.3f} {layer['threshold']:10.4g} "
              f"{layer['top10']:7.3f} {layer['top20']:7.3f} {layer['top50']:7.3f}")
    scaled = " times its Fisher scale" if profile.rule == "fisher" else ""
    rule = ("ReLU: active means > 0" if profile.target_sparsity is None
            else f"active means |act(gate)|{scaled} > threshold, calibrated to sparsity {profile.target_sparsity}")
    print(f"mean sparsity {profile.mean_sparsity:.3f} over {len(profile.layers)} FFN layers; "
          f"{profile.tokens} tokens of {profile.calib} (seed {profile.seed}); {rule}")
    print("topN%: share of all activations that the N% most active neurons account for")


def cmd_sparsify(args: argparse.Namespace) -> None:
    """``picc sparsify``: make SOURCE's FFNs sparse and write the IR with its predictors."""
    from picc.frontend.picc_file import save_picc
    from picc.sparsity.sparsify import sparsify

    options = _sparsify_options(args)
    out = _picc_output(args.output)
    _check_dump_dir(args)
    model = _load(args.source)
    module = sparsify(model, options, _instruments(args), report=lambda line: print(line, file=sys.stderr))
    save_picc(replace(model, module=module), out)
    modes: dict[str, int] = {}
    for op in module.ops():
        if op.NAME in ("ffn", "sparse_ffn"):
            mode = getattr(op, "mode", "dense")
            modes[mode] = modes.get(mode, 0) + 1
    print(f"wrote {args.output}: " + ", ".join(f"{n} {m} FFN layers" for m, n in sorted(modes.items())),
          file=sys.stderr)


def cmd_eval(args: argparse.Namespace) -> None:
    """``picc eval``: perplexity, and with ``--compare-dense`` what sparsity costs against dense."""
    from picc.progress import progress_bar
    from picc.sparsity.evaluation import eval_windows, evaluate

    if args.max_tokens < 2:
        raise PiccError(f"--max-tokens {args.max_tokens}: expected at least 2")
    _check_window(args.window)
    model = _load(args.source)
    if model.tokenizer is None:
        raise PiccError(f"{model.source}: the model has no tokenizer, so {args.ppl} cannot be read")
    window = _within_context(model, min(args.window, args.max_tokens))  # --max-tokens bounds the work
    windows = eval_windows(model.tokenizer, args.ppl, args.max_tokens, window)
    with progress_bar(sum(len(w) for w in windows), "evaluating", "tok") as advance:
        result = evaluate(model.module, model.weights, windows, args.compare_dense, progress=advance)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return
    print(f"perplexity on {args.ppl}: {result.ppl:.4f} ({result.tokens} tokens)")
    if result.ppl_dense is not None:
        print(f"dense perplexity:     {result.ppl_dense:.4f} ({100 * (result.ppl_increase or 0):+.2f}%)")
        print(f"top-1 agreement:      {result.top1_agreement:.4f}")
    if result.ffn_sparsity is not None:
        print(f"measured FFN sparsity: {result.ffn_sparsity:.4f}")
    if result.recall is not None:
        print(f"predictor recall {result.recall:.4f}, precision {result.precision:.4f}")


def cmd_compile(args: argparse.Namespace) -> None:
    """``picc compile``: run the whole pipeline for a target and write OUT.pib."""
    from picc.compile import CompileOptions, compile_model, summary_line, write_compiled
    from picc.fsutil import writable
    from picc.placement.plan_report import format_report

    if not args.output.endswith(".pib"):
        raise PiccError(f"-o {args.output}: expected a file name ending in .pib")
    out = writable(args.output)  # before the work, not after it
    _check_dump_dir(args)
    if args.dense:
        given = [flag for flag, value in (("--sparsity-mode", args.sparsity_mode != "auto"),
                                          ("--target-sparsity", args.target_sparsity is not None),
                                          ("--max-ppl-increase", args.max_ppl_increase is not None),
                                          ("--predictors", args.predictors is not None)) if value]
        if given:
            raise PiccError(f"--dense compiles without sparsity: {given[0]} does not apply")
    options = CompileOptions(target=args.target, vram=args.vram, ctx=args.ctx,
                             dense=args.dense, sparse=args.sparse, float_dots=args.float_dots, int_dots=args.int_dots,
                             int8_dots=args.int8_dots, kv_cache=args.kv_cache,
                             batch_step=not args.no_batch_step, solver=args.solver,
                             sparsity=_sparsify_options(args))
    options = replace(options, target=options.check())  # checked before the model loads; loaded once
    def say(line: str) -> None:
        print(line, file=sys.stderr)

    say(f"loading {args.source}")
    model = _load(args.source)
    for note in model.notes:
        say(f"note: {note}")
    trained = model.module.attr("max_position")
    if isinstance(trained, int) and args.ctx > trained:
        say(f"note: --ctx {args.ctx} is past the {trained} positions {args.source} was trained for; what it "
            f"generates past position {trained} is not what it learned")
    inst = _instruments(args)

    def stage_done(name: str, module: object) -> None:
        say(f"  {name}: {inst.timings[-1][1]:.1f} s")

    inst.on_pass = stage_done
    compiled = compile_model(model, options, inst, say=say)
    size = write_compiled(compiled, out)
    if args.verbose:
        print(format_report(compiled.report), file=sys.stderr)
    say(summary_line(compiled, out, size))
    if args.verbose:
        say(f"peak memory: {_peak_rss() / 2**30:.2f} GiB resident")


def _peak_rss() -> int:
    """Bytes: the most this process (or the largest of the tools it ran) held in memory at once."""
    import resource

    kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return kib * 1024  # Linux counts kibibytes


def cmd_inspect(args: argparse.Namespace) -> None:
    """``picc inspect``: print a .pib's placement report; optionally plot it or write its CUDA sources."""
    from picc.fsutil import writable, write_text_atomic
    from picc.pib import open_pib
    from picc.placement.plan_report import format_report, plot_report
    from runtime.cpu_manifest import CpuManifest
    from runtime.text import TextCodec

    if args.plot:
        writable(args.plot)
    if args.emit_cuda:
        writable(args.emit_cuda, directory=True)
    with open_pib(Path(args.model)) as pib:
        report = pib.json("report")
        meta = pib.json("meta")
        step_bits = CpuManifest.from_json(pib.json("cpu/manifest")).prefill.step_bits
        text = TextCodec(pib.text("tokenizer")) if pib.has("tokenizer") else None
        if args.emit_cuda:
            sources = [name for name in pib.sections if name.startswith("cuda/") and name.endswith(".cu")]
            if not sources:
                raise PiccError(f"{args.model}: carries no CUDA code (nothing is placed on a GPU)")
            out = Path(args.emit_cuda)
            out.mkdir(parents=True, exist_ok=True)
            for name in sources:
                write_text_atomic(out / Path(name).name, pib.text(name))
            print(f"wrote {len(sources)} CUDA sources to {out}", file=sys.stderr)
    if args.plot:
        plot_report(report, Path(args.plot))
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.model}: compiled from {meta.get('source')} by picc {meta.get('picc_version')}")
    print(format_report(report))
    if text is not None:
        stops = ", ".join(f"{text.backend.id_to_token(t)} ({t})" for t in sorted(text.stop_ids)) or "none"
        print(f"replies end at: {stops}")
    print("prompts: the chunk programs compute each token's decode-step bits, so picc serve takes a reply's KV rows "
          "for the next turn's prompt" if step_bits else "prompts: the chunk programs' sums are not the decode "
          "step's, so picc serve takes KV rows of whole 32-token prompt chunks only (docs/serving.md)")


def _sparsify_options(args: argparse.Namespace):  # noqa: ANN202 - SparsifyOptions
    """The sparsity flags as ``SparsifyOptions``, after checking their ranges."""
    from picc.sparsity.calib import check_source
    from picc.sparsity.sparsify import SparsifyOptions

    if not 0 < args.recall <= 1:
        raise PiccError(f"--recall {args.recall}: expected a share in (0, 1]")
    if not 0 < args.predictor_budget <= 1:
        raise PiccError(f"--predictor-budget {args.predictor_budget}: expected a share of the FFN weights in (0, 1]")
    if args.target_sparsity is not None and not 0 <= args.target_sparsity < 1:
        raise PiccError(f"--target-sparsity {args.target_sparsity}: expected a value in [0, 1)")
    if args.max_ppl_increase is not None and args.max_ppl_increase < 0:
        raise PiccError(f"--max-ppl-increase {args.max_ppl_increase}: expected a value >= 0")
    if args.target_sparsity is not None and args.max_ppl_increase is not None:
        raise PiccError("--target-sparsity and --max-ppl-increase: give one (a sparsity, or the "
                        "perplexity cost that chooses it)")
    _check_calibration_tokens(args)
    check_seed(args.seed)
    check_source(args.calib)  # where the compile would choose dense, and never read it, too
    if args.predictors is not None and not Path(args.predictors).is_dir():
        raise PiccError(f"--predictors {args.predictors}: no such directory")
    return SparsifyOptions(
        mode=args.sparsity_mode, target_sparsity=args.target_sparsity,
        max_ppl_increase=args.max_ppl_increase, recall=args.recall, budget=args.predictor_budget,
        predictors=args.predictors, calib=args.calib, rule=args.threshold_rule, tokens=args.tokens,
        fisher_tokens=args.fisher_tokens, seed=args.seed)


def _check_dump_dir(args: argparse.Namespace) -> None:
    """``--dump-ir DIR``, checked before the work."""
    from picc.fsutil import writable

    if args.dump_ir:
        writable(args.dump_ir, directory=True)


def _instruments(args: argparse.Namespace, out=sys.stderr):  # noqa: ANN001, ANN202 - TextIO, Instruments
    """The pass instruments that ``--print-after*``, ``--dump-ir``, ``--time-passes`` and ``--no-verify``
    ask for."""
    from picc.passes import Instruments

    return Instruments(verify=not args.no_verify, print_after_all=args.print_after_all,
                       print_after=frozenset(args.print_after or ()),
                       dump_dir=Path(args.dump_ir) if args.dump_ir else None, time_passes=args.time_passes,
                       out=out)
