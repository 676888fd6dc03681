"""Our Triton kernels' specializations: recorded once per Triton version and GPU, compiled in parallel at start-up.

A Triton kernel compiles on its first call, for the argument types and
properties (dtypes, 16-divisibility, constexprs) of that call. On a fresh
machine that puts our ~22 s of kernel compiles on a cold k3-mini start's
critical path, one after another (benchmarks/results/compile_startup.md).
Triton can replay a recorded specialization (`JITFunction.preload`) and build
several kernels at once (`triton.AsyncCompileMode` on a thread pool; how well
the threads overlap is what benchmarks/triton_compile_parallel.py measures). So:

    python -m kernels.specializations record -- TRAINER ARGS    (on the GPU, once per Triton version)

runs two training updates and writes every specialization of the `kernels`
package that compiled to kernels/specializations/triton-<version>-<backend>-<arch>.json;
the trainer's `Precompile` (kernels.precompile_threads) finds the file that
matches the running Triton and GPU at start-up and compiles its entries in a
background thread pool while the model is built and traced. A kernel called
before its compile finished waits for that compile instead of starting its
own; a specialization that is not recorded compiles at its first call as
before. Nothing here can change a result: it only decides when kernels
compile.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import triton

DIRECTORY = Path(__file__).resolve().parent / "specializations"
PACKAGE = "kernels."


def _target() -> dict:
    from triton.runtime import driver

    return dict(driver.active.get_current_target().__dict__)


def manifest_name(target: dict, version: str = triton.__version__) -> str:
    """'triton-3.6.0-cuda-90.json' for a target {'backend': 'cuda', 'arch': 90, ...}."""
    return f"triton-{version}-{target['backend']}-{target['arch']}.json"


@contextmanager
def recording(package: str = PACKAGE):
    """Collects (module, qualname, specialization JSON) of every kernel of `package` that compiles in the block.

    NOTE: Triton calls the post-compile hook whenever a JIT function builds a
    kernel, a disk-cache hit included, so a warm machine records as well as a
    fresh one. Autotuned kernels record every config they compiled.
    """
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        raise RuntimeError(f"Triton {triton.__version__} has no jit_post_compile_hook: cannot record specializations")
    entries: dict[str, tuple[str, str, str]] = {}
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, key, fn, compile, **_):
        if fn.module.startswith(package) or fn.module == package.rstrip("."):
            entries[f"{fn.module}:{fn.name}:{key}"] = (fn.module, fn.name, compile["specialization_data"])
        return previous(key=key, fn=fn, compile=compile, **_) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    found: list[tuple[str, str, str]] = []
    try:
        yield found
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        found.extend(entries.values())


def write_manifest(entries: list[tuple[str, str, str]], directory: Path = DIRECTORY, target: dict | None = None) -> Path:
    target = target or _target()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / manifest_name(target)
    rows = sorted({(m, q, d) for m, q, d in entries})
    path.write_text(json.dumps({"triton": triton.__version__, "target": target,
                                "kernels": [{"module": m, "qualname": q, "specialization": d} for m, q, d in rows]},
                               indent=1) + "\n")
    return path


def jit_function(module: str, qualname: str):
    """The JITFunction behind `module.qualname`, through autotuner / heuristics wrappers (each keeps it in `.fn`)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, triton.runtime.JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, triton.runtime.JITFunction):
        raise TypeError(f"{module}.{qualname} is not a Triton JIT function")
    return obj


@dataclass
class Precompile:
    """Our kernels' recorded specializations, compiling in a background thread pool from `start()` on.

    `finish()` waits for every compile and returns a one-line report; a
    manifest that is missing or made by another Triton or GPU is reported, and
    nothing is compiled ahead.
    """

    device: object
    threads: int = 8
    directory: Path = DIRECTORY
    target: dict | None = None
    """The GPU target the manifest must match (None: the current device's)."""
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""
    _thread: threading.Thread | None = None
    _path: Path | None = None

    def start(self) -> "Precompile":
        import torch

        async_mode = getattr(triton, "AsyncCompileMode", None)
        if self.target is None:
            # NOTE: Triton asks the current device; without this, a rank other than 0 would open a context on GPU 0.
            torch.cuda.set_device(self.device)
        self._path = self.directory / manifest_name(self.target or _target())
        if async_mode is None:
            self.skipped = f"Triton {triton.__version__} has no AsyncCompileMode"
        elif not self._path.exists():
            self.skipped = f"no recorded specializations for this Triton and GPU ({self._path.name})"
        if self.skipped:
            return self
        manifest = json.loads(self._path.read_text())
        self._thread = threading.Thread(target=self._compile_all, args=(manifest["kernels"], async_mode),
                                        name="titan_k3-precompile", daemon=True)
        self._thread.start()
        return self

    def _compile_all(self, kernels: list[dict], async_mode) -> None:
        import torch

        t0 = time.perf_counter()
        futures = []
        try:
            torch.cuda.set_device(self.device)  # the current device is per thread; Triton compiles for it
            # NOTE: leaving the AsyncCompileMode block waits for every compile; a failed one is dropped from the
            # kernel's cache (ignore_errors), so that kernel compiles at its first call as it would have anyway.
            with ThreadPoolExecutor(self.threads, thread_name_prefix="titan_k3-compile") as pool, \
                    async_mode(pool, ignore_errors=True):
                for k in kernels:
                    try:
                        futures.append((k, jit_function(k["module"], k["qualname"]).preload(k["specialization"])))
                    except Exception as e:  # e.g. a kernel whose signature changed since the recording
                        self.failed.append(f"{k['module']}.{k['qualname']}: {type(e).__name__}: {e}"[:200])
        except Exception as e:
            self.failed.append(f"precompile: {type(e).__name__}: {e}"[:200])
        for k, future in futures:
            if getattr(future, "kernel", future) is None:
                self.failed.append(f"{k['module']}.{k['qualname']}: its compile failed")
            else:
                self.compiled += 1
        self.seconds = time.perf_counter() - t0

    def finish(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self.skipped:
            return f"kernel precompile off: {self.skipped}; our kernels compile on their first call"
        line = f"{self.compiled} kernel specializations from {self._path.name} compiled ahead in {self.seconds:.1f} s " \
               f"({self.threads} threads)"
        return line + (f"; {len(self.failed)} not: {self.failed[0]}" if self.failed else "")


def main(argv: list[str] | None = None) -> int:
    """`record -- TRAINER ARGS`: two updates of the real trainer, then the manifest of what compiled."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "record":
        print("usage: python -m kernels.specializations record -- TRAINER ARGS", file=sys.stderr)
        return 2
    trainer_args = argv[argv.index("--") + 1:] if "--" in argv else []
    import torch

    if not torch.cuda.is_available():
        print("kernels.specializations record: needs CUDA (the specializations are the GPU's)", file=sys.stderr)
        return 2
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    with recording() as entries:
        trainer = Trainer(load_job_config([*trainer_args, "--training.steps", "2", "--kernels.precompile_threads", "0"]))
        try:
            for _ in range(2):
                trainer.train_step()
            torch.cuda.synchronize()
        finally:
            trainer.close()
    path = write_manifest(entries)
    print(f"{len(entries)} specializations of {len({(m, q) for m, q, _ in entries})} kernels -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
