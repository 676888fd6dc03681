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


def run_without_interpreter(code: str) -> None:
    """Run `code` in a fresh Python without TRITON_INTERPRET (which turns `triton.jit` into plain functions);
    building JIT functions needs no GPU. Its assertions fail the test with their message."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


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
    assert precompile.compiled == 0 and precompile._executor is None
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
    run_without_interpreter(code)


def test_every_committed_specialization_matches_its_kernel_as_it_is_now():
    """A manifest entry for a kernel since removed or re-signed compiles nothing useful: the first call compiles at
    start-up again, silently slower. Each committed entry must name a kernel that exists, with the recorded
    parameters in order; otherwise re-record (python -m titan_k3.tools.record_specializations --fresh, on the GPU)."""
    code = (
        "import json, pathlib\n"
        "from kernels.specializations import DIRECTORY, jit_function\n"
        "stale = []\n"
        "for path in sorted(pathlib.Path(DIRECTORY).glob('*.json')):\n"
        "    for k in json.loads(path.read_text())['kernels']:\n"
        "        recorded = list(json.loads(k['specialization'])['signature'])\n"
        "        try:\n"
        "            now = list(jit_function(k['module'], k['qualname']).arg_names)\n"
        "        except (ImportError, AttributeError, TypeError) as e:\n"
        "            now = repr(e)\n"
        "        if now != recorded:\n"
        "            stale.append(f\"{path.name}: {k['module']}.{k['qualname']}: recorded {recorded}, now {now}\")\n"
        "assert not stale, 'stale specializations:\\n' + '\\n'.join(stale)\n"
    )
    run_without_interpreter(code)


def test_a_first_call_waits_for_its_running_compile_and_compiles_a_queued_one_itself(tmp_path, monkeypatch):
    """One worker: kernel A compiles (until released), B and C queue. B's first call takes B over (no wait); A's
    waits for A; C's compile fails and is reported by name. Triton calls the same hook from inside A's compile: that
    call must not wait for itself."""
    import threading

    import triton

    import kernels.specializations as specializations

    started, release, inside_a = threading.Event(), threading.Event(), []

    def fake_preload(module, qualname, specialization, device_index=None):
        key = json.loads(specialization)["key"]
        fn = type("Info", (), {"module": module, "name": qualname})
        if qualname == "A":
            started.set()
            hook = triton.knobs.runtime.jit_cache_hook  # as Triton's preload calls it, on the worker thread
            assert hook is not None, "the hook was installed after the compiles started"
            hook(key=key, fn=fn)
            inside_a.append(True)
            assert release.wait(30), "A was never released"
        if qualname == "C":
            raise RuntimeError("no such kernel")

    monkeypatch.setattr(specializations, "_preload", fake_preload)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    entries = [("kernels.fake", name, json.dumps({"key": f"key-{name}"})) for name in "ABC"]
    write_manifest(entries, tmp_path, target=H200)
    precompile = Precompile("cuda:0", threads=1, directory=tmp_path, target=H200).start()
    hook = triton.knobs.runtime.jit_cache_hook
    assert hook == precompile._before_compile

    def first_call(name):
        hook(key=f"key-{name}", fn=type("Info", (), {"module": "kernels.fake", "name": name}))

    assert started.wait(30)
    first_call("B")  # queued behind A: cancelled and left to this call, no wait
    assert precompile.waits == 0
    threading.Timer(0.3, release.set).start()
    first_call("A")
    assert inside_a and precompile.waits == 1 and precompile.waited_seconds >= 0.25
    first_call("unrecorded")  # not in the manifest: no wait, counted
    report = precompile.finish()
    assert (precompile.compiled, precompile.at_first_call, precompile.waits) == (1, 1, 1), report
    assert precompile.failed and "kernels.fake.C: RuntimeError: no such kernel" in precompile.failed[0]
    assert "1 not: kernels.fake.C" in report and "compiled 1 still queued" in report
    assert precompile.unrecorded == ["kernels.fake.unrecorded"]
    assert "1 not recorded compiled at their first call (kernels.fake.unrecorded)" in report
    assert triton.knobs.runtime.jit_cache_hook is None, "the hook outlived the precompile"
    assert precompile.finish() == report, "a second finish (the trainer's close) must change nothing"


def test_recordings_of_several_settings_add_up_unless_fresh(tmp_path):
    write_manifest([("kernels.a", "k", '{"key": 1}')], tmp_path, target=H200)
    path = write_manifest([("kernels.a", "k", '{"key": 2}')], tmp_path, target=H200, merge=True)
    assert [k["specialization"] for k in json.loads(path.read_text())["kernels"]] == ['{"key": 1}', '{"key": 2}']
    write_manifest([("kernels.a", "k", '{"key": 3}')], tmp_path, target=H200)
    assert [k["specialization"] for k in json.loads(path.read_text())["kernels"]] == ['{"key": 3}']


def test_each_committed_entrys_cache_key_agrees_with_its_constants():
    """Triton files a preloaded kernel under the entry's `key` but builds it from its constants and signature: an
    entry whose two disagree (say, after a hand edit) would put one kernel under another's key, to be launched
    silently at the wrong call. Per parameter: a constexpr's key slot holds its constant, any other's its type."""
    import ast

    for path in sorted((REPO / "kernels" / "specializations").glob("*.json")):
        for k in json.loads(path.read_text())["kernels"]:
            spec = json.loads(k["specialization"])
            names = list(spec["signature"])
            constants = {names[i]: v for (i,), v in zip(spec["constant_keys"], spec["constant_vals"])}
            key = spec["key"]
            slots = ast.literal_eval(key[: key.index("]{") + 1])
            assert len(slots) == len(names), (path.name, k["qualname"])
            for name, kind, slot in zip(names, spec["signature"].values(), slots):
                if kind == "constexpr":
                    assert slot == ("constexpr", constants[name]), (path.name, k["qualname"], name)
                else:
                    assert name not in constants and slot[0] == kind, (path.name, k["qualname"], name)
