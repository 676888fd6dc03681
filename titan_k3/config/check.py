"""Checks of a configuration against this host, and `python -m titan_k3.config.check`.

`load_job_config` checks what the text alone decides (keys, types, ranges,
combinations). `check_host` adds what only the host can answer, before any
work: the optional packages it turns on are installed, the dataset exists and
has the sources `data.mixture` names, the files the run reads exist, the
compile cache's folder and the run's directory in job.dump_folder can be
created, the metrics port can be listened on.

    python -m titan_k3.config.check [-] [--section.key value ...]

takes the trainer's own arguments ('-' first: the TOML text on stdin instead
of `--job.config_file`), prints 'config ok' and exits 0, or prints one line
`error: ...` to stderr and exits CONFIG_ERROR_EXIT. Torch-free: the control
service runs it before it accepts a run; `python -m titan_k3.train
--job.validate_only` runs the same checks and the trainer's own that need no
model (the device, the tokenizer's vocabulary, job.strict's fallbacks, the mesh
against the launch's world size, the evaluator, the run directory's name, the
checkpoint the run starts from).

NOTE: of the run directory this check looks only at job.dump_folder: a reused
job.name is refused by the trainer (titan_k3/metrics/run_dir.py:run_dir_problem),
which reads the previous run's files and checkpoints; the service names each
run afresh, in a folder it has created (service/settings.py:run_args).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
from pathlib import Path

from titan_k3.config.errors import ConfigError, toml_value
from titan_k3.config.job_config import JobConfig
from titan_k3.config.manager import load_job_config
from titan_k3.config.validate import parse_context_stages, parse_mixture

USAGE = """usage: python -m titan_k3.config.check [-] [--section.key value ...]

Checks the trainer's arguments on this host ('-' first: the TOML text on stdin instead of --job.config_file):
prints 'config ok' and exits 0, or one line 'error: ...' on stderr and exits 2. The keys: python -m titan_k3.train --help"""

CONFIG_ERROR_EXIT = 2
"""Exit status of the trainer (and of this check) for a configuration error: retrying cannot help."""


def unusable_folder(folder: Path) -> str | None:
    """Why folders cannot be created under `folder` (it or its nearest existing parent), or None.

    NOTE: a folder is created there and removed: os.access answers from the permission bits, which root passes
    everywhere, so a pseudo-filesystem (/proc, /sys) read as writable and the run then failed to create its folder.
    """
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so the folder cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user" if existing != folder else "is not writable by this user"
    try:
        probe = tempfile.mkdtemp(prefix=".titan_k3-probe-", dir=existing)
    except OSError as e:
        return f"cannot create a folder in {existing} ({e.strerror})"
    os.rmdir(probe)
    return None


def check_port(cfg: JobConfig) -> None:
    """Rank 0's Prometheus endpoint can listen on (metrics.prometheus_host, metrics.prometheus_port)."""
    m = cfg.metrics
    if not m.prometheus_port:
        return
    try:
        family = socket.getaddrinfo(m.prometheus_host, m.prometheus_port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # NOTE: as the exporter's HTTP server does, so a port in TIME_WAIT is not refused here and taken there.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((m.prometheus_host, m.prometheus_port))
    except OSError as e:
        raise port_error(cfg, e) from None


def port_error(cfg: JobConfig, e: OSError) -> ConfigError:
    """The line of a metrics port rank 0 cannot listen on: check_port's, and the run's exporter's."""
    m = cfg.metrics
    return ConfigError(f"config key 'metrics.prometheus_port' = {m.prometheus_port}: cannot listen on "
                       f"{m.prometheus_host}:{m.prometheus_port} ({e.strerror or e})")


def check_data(cfg: JobConfig) -> None:
    """The dataset opens (index and shard sizes) and was built with data.tokenizer, `data.mixture` weighs exactly its
    sources, the loader takes the training split as the run will (the prepare weights it falls back on name sources
    with documents there), and the longest sequence the run asks for fits in that split."""
    from titan_k3.data.shards import open_dataset
    from titan_k3.data.tokenizer import tokenizer_identity

    d = cfg.data
    if d.dataset == "embedded":
        from titan_k3.data.corpus import ensure_embedded_dataset

        path = ensure_embedded_dataset()
    else:
        path = Path(d.dataset)
    try:
        ds = open_dataset(path, verify="size")
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'data.dataset' = {toml_value(d.dataset)}: {e}") from None
    try:
        ds.check_tokenizer(*tokenizer_identity(d.tokenizer))
    except ValueError as e:
        # NOTE: a file that is no tokenizer is that, not another tokenizer than the dataset's; loaded only here, on
        # the way to a refusal (the run loads it once, when it starts)
        load_data_tokenizer(cfg)
        raise ConfigError(f"config key 'data.dataset' = {toml_value(d.dataset)}: {e}") from None
    sources = ds.source_names
    mixture = parse_mixture(d.mixture)
    if mixture is not None:
        unknown = sorted(set(mixture) - set(sources))
        missing = sorted(set(sources) - set(mixture))
        if unknown or missing:
            what = f"unknown source(s) {unknown}" if unknown else f"no weight for source(s) {missing} (0 leaves one out)"
            raise ConfigError(f"config key 'data.mixture' = {toml_value(d.mixture)}: {what}; the dataset has "
                              f"{toml_value(sources)}")
    t = cfg.training
    try:
        # NOTE: what the run's loader takes of the training split (titan_k3/data/loader.py), read here without torch.
        by_source = ds.sources_with_documents("train")
        if mixture is None:
            ds.prepared_weights("train")
    except ValueError as e:
        raise ConfigError(f"config key 'data.dataset' = {toml_value(d.dataset)}: {e}") from None
    empty = sorted(name for name, w in (mixture or {}).items() if name not in by_source and w > 0)
    if empty:
        raise ConfigError(f"config key 'data.mixture' = {toml_value(d.mixture)}: source(s) {empty} weighted above 0 "
                          f"have no documents in the training split; it has {toml_value(sorted(by_source))}")
    tokens = sum(int(shard.offsets[-1] - shard.offsets[0]) for shards in by_source.values() for shard in shards)
    key, longest = "training.seq_len", t.seq_len
    if t.context_stages and (stage := max(s for _, s in parse_context_stages(t.context_stages))) > longest:
        key, longest = "training.context_stages", stage
    if longest >= tokens:
        value = toml_value(t.context_stages) if key == "training.context_stages" else longest
        raise ConfigError(f"config key '{key}' = {value}: a row of {longest + 1:,} tokens is longer than the "
                          f"training split of data.dataset = {toml_value(d.dataset)} ({tokens:,} tokens)")


def load_data_tokenizer(cfg: JobConfig):
    """data.tokenizer, loaded as the run loads it; one that does not load is a ConfigError naming the key."""
    from titan_k3.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(cfg.data.tokenizer)
    except ValueError as e:
        raise ConfigError(f"config key 'data.tokenizer' = {toml_value(cfg.data.tokenizer)}: {e}") from None


def check_files(cfg: JobConfig) -> None:
    """Files the run reads exist, each of its kind: tokenizer and evaluation tasks files, the initial checkpoint a
    directory (a checkpoint, a checkpoints folder or an export)."""
    named = [("data.tokenizer", cfg.data.tokenizer, False),
             ("checkpoint.initial_load_path", cfg.checkpoint.initial_load_path, True)]
    named += [("eval.tasks", t.strip(), False) for t in cfg.eval.tasks.split(",") if t.strip()]
    for key, value, folder in named:
        if not value or value == "embedded":
            continue
        path = Path(value)
        if not path.exists():
            raise ConfigError(f"config key '{key}' = {toml_value(value)}: no such file or directory")
        if folder and not path.is_dir():
            raise ConfigError(f"config key '{key}' = {toml_value(value)}: not a directory (expected a checkpoint "
                              "step-N directory, a checkpoints folder or an exported model)")
        if not folder and path.is_dir():
            raise ConfigError(f"config key '{key}' = {toml_value(value)}: is a directory, not a file")


def check_compile_cache(cfg: JobConfig) -> None:
    """compile.cache_dir, which the run creates when it compiles, can be created (a folder of /proc could not: the
    run stopped on a bare OSError after building its model)."""
    c = cfg.compile
    if not (c.enable and c.cache_dir):
        return
    why = unusable_folder(Path(c.cache_dir).expanduser())
    if why:
        raise ConfigError(f"config key 'compile.cache_dir' = {toml_value(c.cache_dir)}: {why}")


def dump_folder_problem(cfg: JobConfig) -> str | None:
    """The line that refuses job.dump_folder, where the run creates its directory, or None: check_dump_folder's, and
    the run's and --job.validate_only's (titan_k3/metrics/run_dir.py:run_dir_problem)."""
    why = unusable_folder(Path(cfg.job.dump_folder))
    return f"config key 'job.dump_folder' = {toml_value(cfg.job.dump_folder)}: {why}" if why else None


def check_dump_folder(cfg: JobConfig) -> None:
    """job.dump_folder can hold the run's directory (a folder of /proc could not: the run stopped there, before its
    model, and this check had said 'config ok')."""
    problem = dump_folder_problem(cfg)
    if problem:
        raise ConfigError(problem)


def check_packages(cfg: JobConfig) -> None:
    """The optional packages the configuration turns on are installed (metrics.enable_tensorboard: tensorboard).
    NOTE: found, not imported: this check stays torch-free and fast; the trainer imports it when the run starts."""
    if cfg.metrics.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("config key 'metrics.enable_tensorboard' = true: the tensorboard package is not installed; "
                          "pip install tensorboard or set it to false")


def check_host(cfg: JobConfig) -> None:
    """Every host check; raises ConfigError with one line naming the key."""
    check_packages(cfg)
    check_files(cfg)
    check_data(cfg)
    check_compile_cache(cfg)
    check_dump_folder(cfg)
    check_port(cfg)


def config_error(argv: list[str], toml_text: str | None = None) -> str | None:
    """The one-line error of the trainer's arguments (`toml_text`: in place of --job.config_file), or None."""
    try:
        check_host(load_job_config(argv, toml_text=toml_text, resolved=False))
    except ValueError as e:  # ConfigError, and the dataset reader's own ValueErrors
        return " ".join(str(e).split())
    return None


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    toml_text = None
    if argv[:1] == ["-"]:
        argv, toml_text = argv[1:], sys.stdin.read()
    error = config_error(argv, toml_text)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    print("config ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
