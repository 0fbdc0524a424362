"""What the runtime tests (``test_runtime*.py``) share: prompts, compiling a model into a .pib,
the runtime's logits of a prompt fed whole or in parts, and the checks against the interpreter."""

from __future__ import annotations

import numpy as np

from picc.compile import CompileOptions, compile_model, write_compiled
from picc.interpreter import Interpreter
from picc.pib import load_pib
from runtime.session import Session

TOKENS = [1, 5, 9, 2, 17, 33, 4, 60, 8, 3, 21, 11]
# Long enough for two chunks of the batched prefill (32 tokens each), fed in three prompts.
LONG = [(7 * i + 3) % 61 for i in range(45)]
CUTS = (1, 38, 45)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def compiled(model, tmp_path, name: str, **options) -> tuple:
    """``model`` compiled into a .pib (without the server's batch step unless ``batch_step=True``:
    tests/test_engine.py tests it, and its kernels cost each distinct compile ~2-3 s of LLVM)."""
    options.setdefault("batch_step", False)
    result = compile_model(model, CompileOptions(**options), say=lambda _: None)
    path = tmp_path / f"{name}.pib"
    write_compiled(result, path)
    return path, load_pib(path)


def runtime_logits(path, ids, threads: int = 1) -> np.ndarray:
    with Session(path, threads) as s:
        return s.feed(list(ids), all_logits=True)


def prefill_logits(path, ids, cuts, threads: int = 1) -> np.ndarray:
    """The last token's logits of each prompt ``ids[a:b]`` (b in ``cuts``) fed one after another:
    all but each prompt's last token go through the batched prefill program, at positions that
    start mid-cache for the later prompts."""
    rows, start = [], 0
    with Session(path, threads) as s:
        for end in cuts:
            rows.append(s.feed(list(ids[start:end])).copy())
            start = end
    return np.array(rows)


def check_batch_rows(path, tokens, threads: int = 2, others=None) -> None:
    """Two sequences through the server's batch step, ``tokens`` and ``others`` (default: the
    same tokens): each row's logits are its one-sequence step's, bit for bit."""
    from runtime.sequences import SequencePool

    rows = [list(tokens), list(others if others is not None else tokens)]
    expected = []
    for row in rows:
        with Session(path, threads) as s:
            expected.append([s.feed([t]).copy() for t in row])
    with Session(path, threads) as session:
        cpu, pool = session.executor.cpu, SequencePool(session.executor, 2)
        slots = [pool.acquire() for _ in range(2)]
        for step in range(len(rows[0])):
            cpu.batch_step([row[step] for row in rows], [step, step], pool.pointers(slots))
            for r in range(2):
                np.testing.assert_array_equal(cpu.batch_logits(r).view(np.uint32), expected[r][step].view(np.uint32))


def check_prefill(path, pib, tol: float) -> None:
    reference = Interpreter(pib.module, pib.weights).run(LONG)[[c - 1 for c in CUTS]]
    for threads in (1, 2):
        assert rel_err(prefill_logits(path, LONG, CUTS, threads), reference) <= tol, threads


def check_runs_as_interpreted(path, pib, tol: float = 1e-4) -> None:
    """The compiled file's decode steps (two threads), prefill chunks and server batch rows against
    the interpreter on ``pib``: logits within ``tol``, the batch rows the steps' bits."""
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    assert rel_err(runtime_logits(path, TOKENS, threads=2), reference) <= tol
    check_prefill(path, pib, tol)
    check_batch_rows(path, TOKENS[:4])


# Where values are rounded on the way (x to int8 for a q8_0 head or every rows8 op with
# --int8-dots; keys and values to f16 in the caches), each rounded element is a step function of
# its float value. The runtime's sums and the interpreter's are the same values in another order
# (~1e-7 apart); where the two straddle a rounding boundary the element moves a whole step, and
# over a dozen positions the logits move by up to ~5e-3 (int8 steps, 1/254 of a block's largest
# |x|: 4.6e-3 measured, one such element in --int8-dots Q4_0 with numpy's OpenBLAS on its Haswell
# kernels, none on its SkylakeX kernels) or ~1e-4 (f16 steps, 2^-11 of the element: 5.2e-5 and
# 1.1e-4 measured). Which input straddles is chance, changed by any change to a kernel's order of
# sums. So rounding alike is checked where few elements are rounded: each token alone at position
# 0 must give the interpreter's logits to the unrounded bound (``tight``) for all but a tenth of
# the tokens (none straddled in 40 tokens on either kernel set; a kernel that rounded otherwise
# than the interpreter, int8 x to int16 say, misses 1e-4 on every token: ~1e-2 here). Longer
# prompts and the prefill are held to ``loose``: for int8 x 3e-2, the end-to-end bound set for it.
INT8_END_TO_END = 3e-2


def check_rounds_alike(path, pib, tight: float = 1e-4, loose: float = INT8_END_TO_END, n_tokens: int = 20) -> None:
    with Session(path, 2) as s:
        errors = []
        for token in range(n_tokens):
            s.reset()
            alone = s.feed([token])[None]
            errors.append(rel_err(alone, Interpreter(pib.module, pib.weights).run([token])))
    errors = np.array(errors)
    assert (errors <= tight).sum() >= 0.9 * n_tokens and errors.max() <= loose, errors
    reference = Interpreter(pib.module, pib.weights).run(TOKENS)
    for threads in (1, 2):
        assert rel_err(runtime_logits(path, TOKENS, threads=threads), reference) <= loose, threads
    check_prefill(path, pib, loose)
