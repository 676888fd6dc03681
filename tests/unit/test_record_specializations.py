"""`python -m titan_k3.tools.record_specializations`: the command line is checked before anything runs."""

from __future__ import annotations

import pytest

from titan_k3.tools.record_specializations import main


@pytest.mark.parametrize("argv", [["--merge", "--", "--model.flavor", "debug"], ["record", "--", "--model.flavor", "debug"]])
def test_record_refuses_an_unknown_option_before_anything_runs(argv, capsys):
    assert main(argv) == 2
    assert "usage: python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS" in capsys.readouterr().err
