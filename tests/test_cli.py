"""The command line: import -> opt -> logits, --help everywhere, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_llama

from picc.cli import build_parser, main
from picc.frontend import load_model
from picc.frontend.picc_file import save_picc
from picc.interpreter import Interpreter
from picc.ir import parse

COMMANDS = ["import", "opt", "logits", "generate"]


def every_command() -> list[str]:
    """Every subcommand the parser knows (``picc compile --help`` once crashed on a ``%`` in its
    help text while the commands listed above were fine)."""
    (sub,) = [a for a in build_parser()._actions if a.choices and a.dest == "command"]
    return list(sub.choices)


@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny.picc"
    save_picc(tiny_llama("reglu", n_layers=2), path)
    return path


def test_import_opt_logits_pipeline(tiny_file, tmp_path, capsys):
    out = tmp_path / "opt.picc"
    dump = tmp_path / "ir"
    assert main(["opt", str(tiny_file), "-p", "canonicalize,dce", "-o", str(out),
                 "--dump-ir", str(dump), "--time-passes"]) == 0
    assert "canonicalize" in capsys.readouterr().out
    assert sorted(p.name for p in dump.iterdir()) == ["00_input.picc", "01_canonicalize.picc",
                                                       "02_dce.picc"]
    assert parse(out.read_text()) == parse(tiny_file.read_text())
    npy = tmp_path / "l.npy"
    assert main(["logits", str(out), "--tokens", "1,2,3,4,5", "--out", str(npy)]) == 0
    logits = np.load(npy)
    model = tiny_llama("reglu", n_layers=2)
    want = Interpreter(model.module, model.weights).run([1, 2, 3, 4, 5])
    assert logits.shape == (5, 128) and logits.dtype == np.float32
    np.testing.assert_array_equal(logits, want)


def test_opt_can_print_the_ir(tiny_file, capsys):
    assert main(["opt", str(tiny_file), "-p", "dce", "-o", "-"]) == 0
    assert parse(capsys.readouterr().out) == load_model(tiny_file).module


@pytest.mark.parametrize("command", every_command())
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: picc {command}")
    assert len(out.splitlines()) > 5


def test_opt_help_lists_every_pass_and_other_commands_do_not_import_them(capsys):
    import subprocess
    import sys

    from picc.passes import PASSES

    with pytest.raises(SystemExit):
        main(["opt", "--help"])
    words = capsys.readouterr().out.split()
    assert all(f"{name}:" in words for name in PASSES), words  # whole: not broken at a hyphen
    # The listing is made when help is shown: building the parser (every command does) must not
    # import the passes and what they import (~0.6 s of picc run's start-up).
    code = "import sys; from picc.cli import build_parser; build_parser(); print('picc.passes' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_runtime_commands_default_to_every_available_core(monkeypatch, capsys):
    # picc run / bench / logits leave --threads unset; the runtime then uses the cores the process
    # may run on (its affinity), as many as the compiled code allows; --help says how many.
    from picc.targets import host

    monkeypatch.setattr(host, "host_cores", lambda: 3)
    for command in ("run", "bench", "logits"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "the cores this process may use, 3 here" in " ".join(capsys.readouterr().out.split())


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # exactly one line
    assert err.startswith("picc: error: ")
    return err


def test_errors_are_one_line(tiny_file, tmp_path, capsys):
    assert "no such file, directory or alias" in _error(
        ["logits", "nosuchmodel", "--tokens", "1", "--out", str(tmp_path / "x.npy")], capsys)
    assert "unknown pass 'fold'" in _error(
        ["opt", str(tiny_file), "-p", "fold", "-o", str(tmp_path / "o.picc")], capsys)
    assert "token id 500 is out of range for a vocabulary of 128" in _error(
        ["logits", str(tiny_file), "--tokens", "1,500", "--out", str(tmp_path / "x.npy")], capsys)
    assert "--tokens '1,x': expected comma-separated integers" in _error(
        ["logits", str(tiny_file), "--tokens", "1,x", "--out", str(tmp_path / "x.npy")], capsys)
    assert "the model has no tokenizer; pass --tokens instead" in _error(
        ["logits", str(tiny_file), "--text", "hi", "--out", str(tmp_path / "x.npy")], capsys)
    assert "directory has no config.json" in _error(
        ["import", str(tmp_path), "-o", str(tmp_path / "y.picc")], capsys)
    assert "directory" in _error(
        ["import", str(tiny_file), "-o", str(tmp_path / "missing" / "y.picc")], capsys)
    assert not (tmp_path / "x.npy").exists()


def test_a_broken_ir_file_names_the_file_and_line(tiny_file, tmp_path, capsys):
    text = tiny_file.read_text().replace("rms_norm", "rms_nrom", 1)
    bad = tmp_path / "bad.picc"
    bad.write_text(text)
    (tmp_path / "bad.picc.weights").write_bytes((tmp_path / "tiny.picc.weights").read_bytes())
    err = _error(["logits", str(bad), "--tokens", "1", "--out", str(tmp_path / "z.npy")], capsys)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "rms_nrom" in t)
    assert f"bad.picc: line {line}, column" in err and "expected a known op" in err


def test_a_corrupt_weight_file_is_refused(tiny_file, tmp_path, capsys):
    (tmp_path / "tiny.picc.weights").write_bytes(b"not safetensors at all")
    err = _error(["logits", str(tiny_file), "--tokens", "1", "--out", str(tmp_path / "z.npy")],
                 capsys)
    assert "tiny.picc.weights: not a picc weight file" in err


def test_console_script_runs_and_exits_nonzero_on_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "picc.cli", "logits", str(tmp_path / "none.gguf"),
                           "--tokens", "1", "--out", str(tmp_path / "o.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"picc: error: {tmp_path / 'none.gguf'}: GGUF file not found"


def test_parser_knows_all_commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)


def test_outputs_are_checked_before_any_work(tiny_file, tmp_path, capsys, monkeypatch):
    # An output that cannot be written used to be found out after the work (a whole compile),
    # and some not even then: a directory as -o was an internal error, a .picc's weights left
    # behind; import -o m.txt wrote a file no command reads. Nothing is loaded here: every one of
    # these fails first.
    def no_loading(source):
        raise AssertionError(f"loaded {source} before checking the outputs")

    monkeypatch.setattr("picc.cli_commands._load", no_loading)
    folder = tmp_path / "folder.pib"
    folder.mkdir()
    (tmp_path / "a_file").write_text("")
    cases = [
        (["compile", "smollm2", "--dense", "-o", str(folder)], "is a directory"),
        (["compile", "smollm2", "--dense", "-o", str(tmp_path / "none" / "c.pib")], "does not exist"),
        (["compile", "smollm2", "--dense", "-o", str(tmp_path / "a_file" / "c.pib")], "is not a directory"),
        (["compile", "smollm2", "--dense", "-o", str(tmp_path / "c.pib"), "--dump-ir", str(tmp_path / "a_file")],
         "exists and is not a directory"),
        (["import", str(tiny_file), "-o", str(tmp_path / "m.txt")], "expected a file name ending in .picc"),
        (["import", str(tiny_file), "-o", ""], "expected a file name ending in .picc"),
        (["sparsify", str(tiny_file), "-o", str(tmp_path / "s.pib")], "expected a file name ending in .picc"),
        (["logits", str(tiny_file), "--tokens", "1", "--out", str(folder)], "is a directory"),
        (["profile", str(tiny_file), "--plot", str(tmp_path / "none" / "p.png")], "does not exist"),
        (["opt", str(tiny_file), "-p", "dce", "-o", str(tmp_path / "o.picc"), "--print-after", "cse"],
         "--print-after cse: not a pass of this pipeline"),
    ]
    for argv, message in cases:
        assert message in _error(argv, capsys), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder.pib", "tiny.picc", "tiny.picc.weights"]


def test_options_that_contradict_each_other_or_make_no_sense_are_refused(tiny_file, tmp_path, capsys):
    out = str(tmp_path / "c.pib")
    for argv, message in [
        (["compile", "smollm2", "-o", out, "--target-sparsity", "0.3", "--max-ppl-increase", "0.05"],
         "--target-sparsity and --max-ppl-increase: give one"),
        (["compile", "smollm2", "-o", out, "--dense", "--sparsity-mode", "predictor"],
         "--dense compiles without sparsity: --sparsity-mode does not apply"),
        (["compile", "smollm2", "-o", out, "--predictors", str(tmp_path / "none")], "no such directory"),
        (["compile", "smollm2", "-o", out, "--tokens", "0"], "--tokens 0: expected at least 1"),
        (["compile", "smollm2", "-o", out, "--target", str(tmp_path)], "is a directory, not a target file"),
        (["compile", "smollm2", "-o", out, "--calib", str(tmp_path / "none.txt")], "is neither a built-in corpus"),
        (["generate", str(tiny_file), "-p", "hi", "--temperature", "nan"], "expected a finite value >= 0"),
        (["generate", str(tiny_file), "-p", "hi", "--seed", "-1"], "--seed -1: expected an integer >= 0"),
        (["eval", str(tiny_file), "--window", "0"], "--window 0: expected at least 2 tokens"),
        (["serve", str(tmp_path / "none.pib"), "--replicas", "3"], "--replicas is for --ray"),
    ]:
        assert message in _error(argv, capsys), argv
    assert not list(tmp_path.glob("*.pib"))


def test_debug_goes_before_or_after_the_command(tiny_file, tmp_path):
    # Every internal error says "run with --debug"; after the command it was an unknown argument.
    for argv in (["--debug", "logits", str(tiny_file)], ["logits", str(tiny_file), "--debug"]):
        args = build_parser().parse_args([*argv, "--tokens", "1", "--out", str(tmp_path / "x.npy")])
        assert args.debug is True
    assert build_parser().parse_args(["logits", str(tiny_file), "--tokens", "1", "--out", "x.npy"]).debug is False


def test_a_write_that_fails_is_one_line_and_leaves_nothing(tiny_file, tmp_path, capsys, monkeypatch):
    # A full disk (or a read-only one) was an internal error with a traceback hint.
    import errno
    import os
    from pathlib import Path

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "x.npy"
    with monkeypatch.context() as m:
        m.setattr(Path, "write_bytes", full)
        err = _error(["logits", str(tiny_file), "--tokens", "1", "--out", str(out)], capsys)
    assert f"cannot write {out}: No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.picc", "tiny.picc.weights"]
    assert main(["logits", str(tiny_file), "--tokens", "1", "--out", str(out)]) == 0
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # as any new file, not mkstemp's 0600
