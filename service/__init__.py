"""The titan_k3 control service: runs trainings over REST and exports what they report.

It launches `torchrun ... -m titan_k3.train` children, keeps a SQLite registry
of runs and attempts, reads each run directory's files, and serves
Prometheus metrics and a small web page. It never imports torch: the trainer
is a subprocess, and configs are validated with the torch-free
`titan_k3.config`.
"""

__all__ = ["create_app", "Settings"]


def __getattr__(name: str):
    # NOTE: lazy so that `python -m service.child` (the per-attempt wrapper) imports nothing heavy.
    if name == "create_app":
        from service.app import create_app

        return create_app
    if name == "Settings":
        from service.settings import Settings

        return Settings
    raise AttributeError(name)
