"""`python -m titan_k3.tools.record_specializations`: the command line is checked before anything runs."""

from __future__ import annotations

import pytest

from titan_k3.tools.record_specializations import main


@pytest.mark.parametrize("argv", [["--merge", "--", "--model.flavor", "debug"], ["record", "--", "--model.flavor", "debug"]])
def test_record_refuses_an_unknown_option_before_anything_runs(argv, capsys):
    assert main(argv) == 2
    assert "usage: python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_is_answered_on_stdout_with_status_0(flag, capsys):
    """It printed the usage on stderr with status 2, as for a wrong option."""
    assert main([flag]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS") and not err


def test_bad_trainer_arguments_are_one_line_before_torch_is_asked(capsys):
    """They were read only on a GPU, after the CUDA check, and a typo ended there in a traceback."""
    assert main(["--", "--training.stepz", "3"]) == 2
    assert capsys.readouterr().err == "error: unknown config key 'training.stepz'; did you mean 'training.steps'?\n"
