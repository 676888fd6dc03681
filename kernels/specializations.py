"""Our Triton kernels' specializations: recorded once per Triton version and GPU, compiled in parallel at start-up.

A Triton kernel compiles on its first call, for the argument types and
properties (dtypes, 16-divisibility, constexprs) of that call. On a fresh
machine that puts our ~22 s of kernel compiles on a cold k3-mini start's
critical path, one after another (benchmarks/results/compile_startup.md).
Triton can replay a recorded specialization (`JITFunction.preload`), so:

    python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS    (on the GPU, per Triton version)

runs two training updates and adds every specialization of the `kernels`
package that compiled to kernels/specializations/triton-<version>-<backend>-<arch>.json
(recordings of several settings add up; --fresh starts the file over);
the trainer's `Precompile` (kernels.precompile_threads) finds the file that
matches the running Triton and GPU at start-up and compiles its entries in a
background thread pool while the model is built and traced. Threads overlap
well: most of a compile (MLIR, LLVM, ptxas) runs without the GIL, and 8
threads built 8 kernels 5.2x faster than one after another on an H200 host;
spawned processes were slower than serial, their start-up included
(benchmarks/results/triton_compile_parallel.md). A kernel called
while its compile runs waits for it instead of compiling it twice; one still
queued compiles at its call, as does a specialization that was not recorded.
Nothing here can change a result: it only decides when and where kernels
compile.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import triton

DIRECTORY = Path(__file__).resolve().parent / "specializations"
PACKAGE = "kernels."
WORKER_THREAD = "titan_k3-precompile"


def _target() -> dict:
    from triton.runtime import driver

    return dict(driver.active.get_current_target().__dict__)


def _ours(module: str, package: str = PACKAGE) -> bool:
    """Whether a kernel defined in `module` belongs to `package` ('kernels.')."""
    return module.startswith(package) or module == package.rstrip(".")


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
        if _ours(fn.module, package):
            entries[f"{fn.module}:{fn.name}:{key}"] = (fn.module, fn.name, compile["specialization_data"])
        return previous(key=key, fn=fn, compile=compile, **_) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    found: list[tuple[str, str, str]] = []
    try:
        yield found
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        found.extend(entries.values())


def write_manifest(entries: list[tuple[str, str, str]], directory: Path = DIRECTORY, target: dict | None = None,
                   merge: bool = False) -> Path:
    """Writes the manifest of `entries` for this Triton and `target`; with merge, keeps the file's earlier entries
    too (recordings of several settings add up)."""
    target = target or _target()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / manifest_name(target)
    rows = {(m, q, d) for m, q, d in entries}
    if merge and path.exists():
        rows |= {(k["module"], k["qualname"], k["specialization"]) for k in json.loads(path.read_text())["kernels"]}
    rows = sorted(rows)
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


def _preload(module: str, qualname: str, specialization: str, device_index: int) -> None:
    """Compiles one recorded specialization and readies it to launch.

    The kernel lands in the kernel's in-memory cache and in the disk cache.
    Readying it loads the binary and builds its launcher, which Triton would
    otherwise do (a C compile) at the first launch.
    """
    import torch
    from triton.runtime.errors import OutOfResources

    torch.cuda.set_device(device_index)  # per thread: Triton compiles for, and loads into, the current device
    kernel = jit_function(module, qualname).preload(specialization)
    try:
        kernel._init_handles()
    except OutOfResources:
        pass  # an autotuner config too big for this GPU: its call prunes it, as it would without a manifest


@dataclass
class Precompile:
    """Our kernels' recorded specializations, compiling in a background thread pool from `start()` on.

    A finished kernel is in memory, ready to launch, at its first call. A first
    call whose specialization is still compiling waits for it (Triton's
    `jit_cache_hook`) instead of compiling it a second time, and
    `waited_seconds` adds up those waits; one still queued is compiled by its
    call. `finish()` waits for every compile and returns a one-line report; a
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
    """From start() to the last compile's end."""
    at_first_call: int = 0
    """Specializations still queued when their first call came: compiled by that call."""
    waits: int = 0
    waited_seconds: float = 0.0
    unrecorded: list[str] = field(default_factory=list)
    """Our kernels that compiled a specialization the manifest lacks, until finish(): one entry per compile."""
    skipped: str = ""
    _pending: dict = field(default_factory=dict)
    """(module, qualname, key) -> (manifest entry, Future of its compile)."""
    _executor: object = None
    _previous_hook: object = None
    _t0: float = 0.0
    _path: Path | None = None

    def start(self) -> "Precompile":
        import torch

        if self.target is None:
            # NOTE: Triton asks the current device; without this, a rank other than 0 would open a context on GPU 0.
            torch.cuda.set_device(self.device)
        self._path = self.directory / manifest_name(self.target or _target())
        knobs = getattr(triton, "knobs", None)
        if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
            self.skipped = f"Triton {triton.__version__} has no jit_cache_hook"
        elif not self._path.exists():
            self.skipped = f"no recorded specializations for this Triton and GPU ({self._path.name})"
        if self.skipped:
            return self
        kernels = json.loads(self._path.read_text())["kernels"]
        self._previous_hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._before_compile
        self._t0 = time.perf_counter()
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=WORKER_THREAD)
        device_index = torch.device(self.device).index or 0
        for k in kernels:
            key = str(json.loads(k["specialization"])["key"])
            future = self._executor.submit(_preload, k["module"], k["qualname"], k["specialization"], device_index)
            future.add_done_callback(self._done)
            self._pending[(k["module"], k["qualname"], key)] = (k, future)
        return self

    def _done(self, future) -> None:
        self.seconds = max(self.seconds, time.perf_counter() - self._t0)

    def _before_compile(self, *, key, fn, **kwargs):
        """Triton's jit_cache_hook: called before any kernel compiles; a first call waits for its pending precompile,
        and one of ours the manifest lacks is counted."""
        entry = self._pending.get((fn.module, fn.name, str(key)))
        worker = threading.current_thread().name.startswith(WORKER_THREAD)
        if entry is None and not worker and _ours(fn.module):
            self.unrecorded.append(f"{fn.module}.{fn.name}")
        if entry is not None and not worker \
                and not entry[1].done() and not entry[1].cancel():  # one still queued is cancelled: compiled here
            t0 = time.perf_counter()
            try:
                entry[1].result()
            except Exception:
                pass  # reported by finish(); this call compiles the kernel itself, as it would have without a manifest
            self.waits += 1
            self.waited_seconds += time.perf_counter() - t0
        return self._previous_hook(key=key, fn=fn, **kwargs) if self._previous_hook else None

    def finish(self) -> str:
        if self.skipped:
            return f"kernel precompile off: {self.skipped}; our kernels compile on their first call"
        if self._executor is not None:
            for k, future in self._pending.values():
                if future.cancelled():
                    self.at_first_call += 1
                    continue
                try:
                    future.result()
                    self.compiled += 1
                except Exception as e:  # e.g. a kernel whose signature changed since the recording
                    self.failed.append(f"{k['module']}.{k['qualname']}: {type(e).__name__}: {e}"[:200])
            self._executor.shutdown()
            self._executor = None
            if triton.knobs.runtime.jit_cache_hook == self._before_compile:
                triton.knobs.runtime.jit_cache_hook = self._previous_hook
        line = (f"{self.compiled} kernel specializations from {self._path.name} compiled ahead in {self.seconds:.1f} s "
                f"({self.threads} threads); first calls waited {self.waited_seconds:.1f} s for {self.waits} of them "
                f"and compiled {self.at_first_call} still queued")
        if self.failed:
            line += f"; {len(self.failed)} not: {self.failed[0]}"
        if self.unrecorded:
            names = ", ".join(sorted(set(self.unrecorded))[:3])
            line += (f"; {len(self.unrecorded)} not recorded compiled at their first call ({names}): "
                     "`python -m titan_k3.tools.record_specializations -- THIS RUN'S ARGS` adds them")
        return line

