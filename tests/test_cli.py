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
