"""Recorded kernel specializations: the manifest's name and contents, finding each kernel, and the start-up report.

Compiling from a manifest needs a GPU (tests/gpu/test_specializations_gpu.py records and replays there).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.specializations import Precompile, manifest_name, write_manifest

REPO = Path(__file__).resolve().parents[2]
H200 = {"backend": "cuda", "arch": 90, "warp_size": 32}


def test_manifest_is_named_for_the_triton_version_and_gpu_and_keeps_each_entry_once(tmp_path):
    assert manifest_name(H200, "3.6.0") == "triton-3.6.0-cuda-90.json"
    entries = [("kernels.b", "k2", '{"key": 2}'), ("kernels.a", "k1", '{"key": 1}'), ("kernels.b", "k2", '{"key": 2}')]
    path = write_manifest(entries, tmp_path / "specializations", target=H200)
    assert path.name.endswith("-cuda-90.json")
    manifest = json.loads(path.read_text())
    assert manifest["target"] == H200
    assert [(k["module"], k["qualname"], k["specialization"]) for k in manifest["kernels"]] == sorted(set(entries))


def test_without_a_manifest_for_this_triton_and_gpu_nothing_compiles_ahead_and_the_report_says_so(tmp_path):
    write_manifest([("kernels.a", "k", "{}")], tmp_path, target={**H200, "arch": 80})  # another GPU's recording
    precompile = Precompile("cuda:0", threads=2, directory=tmp_path, target=H200).start()
    report = precompile.finish()
    assert precompile.compiled == 0 and precompile._thread is None
    assert report.startswith("kernel precompile off:") and manifest_name(H200) in report


def test_each_recorded_kernel_is_found_through_its_autotuner():
    """The manifest names a kernel by module and qualname; autotuned ones are found through the autotuner's `.fn`.

    Run without the interpreter (which turns `triton.jit` into plain functions): building JIT functions needs no GPU.
    """
    code = (
        "import triton\n"
        "from kernels.specializations import jit_function\n"
        "import kernels.grouped_gemm.triton_gemm as g\n"
        "assert isinstance(g.grouped_mm_kernel, triton.runtime.Autotuner)\n"
        "fn = jit_function('kernels.grouped_gemm.triton_gemm', 'grouped_mm_kernel')\n"
        "assert fn is g._grouped_mm_kernel and isinstance(fn, triton.runtime.JITFunction)\n"
        "assert jit_function('kernels.grouped_gemm.triton_gemm', '_grouped_mm_kernel') is fn\n"
        "try:\n"
        "    jit_function('kernels.grouped_gemm.triton_gemm', 'tuned_autotune')\n"
        "except TypeError as e:\n"
        "    assert 'not a Triton JIT function' in str(e)\n"
        "else:\n"
        "    raise AssertionError('a plain function passed as a kernel')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
