"""Record our Triton kernels' specializations from two updates of the real trainer (on the GPU).

    python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS

runs two training updates of `python -m titan_k3.train TRAINER ARGS` under
`kernels.specializations.recording()` and adds every specialization of the
`kernels` package that compiled to the manifest of this Triton version and GPU
(kernels/specializations/triton-<version>-<backend>-<arch>.json); `--fresh`
starts the file over (e.g. after a kernel's signature changed). Recordings of
several settings add up. The trainer's start-up precompile reads that file
(`kernels.precompile_threads`).

It lives here, not beside the kernels, because it drives the trainer: the
`kernels` package imports nothing of titan_k3 (docs/architecture.md §3).
"""

from __future__ import annotations

import json
import sys

USAGE = "usage: python -m titan_k3.tools.record_specializations [--fresh] -- TRAINER ARGS"


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when recorded; 2 for a bad command line, bad trainer arguments or no CUDA device (nothing runs)."""
    argv = sys.argv[1:] if argv is None else argv
    ours = argv[:argv.index("--")] if "--" in argv else argv
    if ours and set(ours) <= {"-h", "--help"}:
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if set(ours) - {"--fresh"}:
        print(USAGE, file=sys.stderr)
        return 2
    trainer_args = argv[argv.index("--") + 1:] if "--" in argv else []
    from titan_k3.config import load_job_config

    try:  # before torch: the trainer's arguments are refused as the trainer refuses them, in one line
        cfg = load_job_config([*trainer_args, "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
                               "--lr_scheduler.warmup_fraction", "0", "--kernels.precompile_threads", "0"])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("record_specializations: needs CUDA (the specializations are the GPU's)", file=sys.stderr)
        return 2
    from kernels.specializations import recording, write_manifest
    from titan_k3.train import Trainer

    with recording() as entries:
        try:
            trainer = Trainer(cfg)
        except ValueError as e:  # ConfigError among them: what the trainer checks as it builds (the device, files)
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            for _ in range(2):
                trainer.train_step()
            torch.cuda.synchronize()
        finally:
            trainer.close()
    path = write_manifest(entries, merge="--fresh" not in ours)
    total = len(json.loads(path.read_text())["kernels"])
    print(f"{len(entries)} specializations of {len({(m, q) for m, q, _ in entries})} kernels recorded; "
          f"{total} in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
