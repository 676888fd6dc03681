"""kernels.device.check_interpreter: Triton's CPU interpreter before 3.7 cannot run with numpy 2.4, and says so in
one line instead of failing every kernel deep inside Triton."""

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

from kernels import device

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("triton_version, numpy_version", [("3.6.0", "2.4.0"), ("3.6.0", "2.4.6"), ("3.5.1", "3.0.0"),
                                                            ("3.6.0+git8a1b2c3", "2.4.0rc1"), ("3.6rc1", "2.4")])
def test_an_old_interpreter_with_numpy_2_4_is_refused_in_one_line(triton_version, numpy_version):
    with pytest.raises(RuntimeError) as info:
        device.check_interpreter(triton_version, numpy_version)
    message = str(info.value)
    assert "\n" not in message
    assert f"Triton {triton_version}'s interpreter" in message and f"numpy {numpy_version}" in message
    assert "'numpy<2.4'" in message and "triton>=3.7" in message


@pytest.mark.parametrize("triton_version, numpy_version", [("3.6.0", "2.3.5"), ("3.6.0", "1.26.4"), ("3.7.0", "2.4.6"),
                                                            ("3.9.0", "2.4.0"), ("3.10.0", "2.5.1"), ("4.0.0", "3.0.0")])
def test_working_combinations_pass(triton_version, numpy_version):
    device.check_interpreter(triton_version, numpy_version)


def test_triton_runs_on_checks_the_interpreter_only_where_it_runs(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    assert device.triton_runs_on("cuda")  # a GPU never uses the interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not device.triton_runs_on("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="cannot run with numpy 2.4.6"):
        device.triton_runs_on("cpu")


def test_the_suite_stops_at_its_start_in_such_an_environment(tmp_path):
    # NOTE: the suite's root conftest, run on a one-test folder with the versions of a broken environment.
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    script = ("import sys, numpy, triton, pytest\n"
              "numpy.__version__, triton.__version__ = '2.4.6', '3.6.0'\n"
              f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {str(tmp_path)!r}]))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Triton 3.6.0's interpreter (TRITON_INTERPRET=1) cannot run with numpy 2.4.6" in run.stdout + run.stderr
    assert "1 passed" not in run.stdout
