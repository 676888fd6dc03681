"""Export a checkpoint to the published K3 layout, and import it back.

    python -m titan_k3.checkpoint.export --checkpoint RUN_DIR/checkpoints/step-N --out DIR
        [--dtype bfloat16|float32] [--max-shard-mb 5000]

The checkpoint's files are first checked against its checksums.json (a
damaged one is named and nothing is written). The export reads the DCP
checkpoint shard by shard (peak memory is one output shard, not the model),
maps names with hf.NAME_MAP, and writes
`model-0000i-of-0000n.safetensors`, `model.safetensors.index.json` and
`config.json` (last: a directory without it holds no complete export). `import_state_dict(DIR)` returns (K3Args, titan_k3 state dict in
float32), which `K3Model.load_state_dict` and `checkpoint.initial_load_path` take.

Beside them, what evaluating the export needs (`python -m titan_k3.eval --checkpoint DIR`):
the tokenizer file the weights were trained with (`tokenizer.json`, or
`tiktoken.model` for a tiktoken BPE; config.json's `titan_k3_tokenizer` names it
with its sha256), the source run's resolved config as `titan_k3_config.toml`
(the settings its evaluation used), and `checksums.json` (integrity.py's format)
over every file the export wrote, config.json included. config.json's
`titan_k3_export` records this layout's version, the source step and its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

from titan_k3.checkpoint import integrity
from titan_k3.checkpoint.hf import (
    args_from_dict,
    args_from_hf_config,
    dcp_tensor_sizes,
    from_hf,
    hf_config,
    read_dcp_tensors,
    to_hf,
)
from titan_k3.checkpoint.layout import META_FILE, TOKENIZER_KEY, is_complete, run_dir_of
from titan_k3.checkpoint.verify import verify
from titan_k3.models.k3.args import K3Args

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
RUN_CONFIG_FILE = "titan_k3_config.toml"
# config.json's record of this layout: {"version", "step", "tokens_seen", "run_config"}. Version 2 added the
# checksums, the tokenizer file and the run config; an export without the key is of version 1.
EXPORT_KEY = "titan_k3_export"
EXPORT_VERSION = 2
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def export_checkpoint(checkpoint: Path, out: Path, *, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write the export of checkpoint dir `checkpoint` into `out`; returns the index dict."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}; must be > 0")
    checkpoint, out = Path(checkpoint), Path(out)
    meta_path = checkpoint / META_FILE
    if not meta_path.is_file() or not is_complete(checkpoint):
        # NOTE: a step-N.tmp-* dir holds a meta.json too: a save in progress, or one a crash cut short.
        raise FileNotFoundError(f"{checkpoint}: not a titan_k3 checkpoint dir (expected RUN_DIR/checkpoints/step-N "
                                f"with {META_FILE} and .metadata)")
    resolved = out.resolve()
    if resolved == checkpoint.resolve() or checkpoint.resolve() in resolved.parents:
        raise ValueError(f"--out {str(out)!r} is inside the checkpoint {str(checkpoint)!r}: its files would no longer "
                         "match its checksums.json; export to a directory of its own")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r}: a file, not a directory")
    earlier = _earlier_export_files(out / CONFIG_FILE)
    problem, _ = verify(checkpoint)
    if problem is not None:
        raise ValueError(f"{checkpoint}: damaged, not exported: {problem}")
    meta = json.loads(meta_path.read_text())
    args = args_from_dict(meta["model_args"])
    out_dtype = DTYPES[dtype]

    # Plan shards on the DCP metadata: consecutive tensors until the byte budget is used.
    sizes = dcp_tensor_sizes(checkpoint)
    shards: list[list[str]] = [[]]
    used = 0
    for key, (size, _) in sizes.items():
        nbytes = size.numel() * out_dtype.itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write_export(checkpoint, out, meta, args, out_dtype, dtype, shards, earlier, save_file)
    except BaseException:
        # NOTE: a failure or a Ctrl-C midway leaves no half export behind: a directory this export created goes
        # whole; in one that was there, the files it wrote so far (an earlier export's index and config are gone
        # already, so what is left reads as no export, never as a mix of two).
        _remove_partial(out, created, n_shards=len(shards))
        raise


def _write_export(checkpoint: Path, out: Path, meta: dict, args: K3Args, out_dtype: torch.dtype, dtype: str,
                  shards: list[list[str]], earlier: set[str], save_file) -> dict:
    """The writing half of `export_checkpoint`: shards, index, run config, tokenizer, checksums, config.json last."""
    # NOTE: an export into a directory holding an earlier one overwrites its shards one by one; were it stopped
    # midway, the earlier index and config beside a mix of new and old shards would import as one model. Without
    # them the directory reads as no export until this one writes its own, config.json last.
    for name in (CONFIG_FILE, integrity.CHECKSUMS_FILE, INDEX_FILE):
        (out / name).unlink(missing_ok=True)
    weight_map, total = {}, 0
    n = len(shards)
    for i, keys in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for key, tensor in read_dcp_tensors(checkpoint, keys=keys).items():
            for hf_name, t, note in to_hf(key.removeprefix("model."), tensor):
                tensors[hf_name] = t.to(torch.float32 if note == "float32" else out_dtype).contiguous()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for hf_name, t in tensors.items():
            weight_map[hf_name] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total, "source_step": meta["step"]}, "weight_map": weight_map}
    _write_json(out / INDEX_FILE, index)
    config = hf_config(args, dtype=dtype, qb_eta=meta.get("qb_eta"))
    written = set(weight_map.values())
    files = [*sorted(written), INDEX_FILE]
    run_config = run_dir_of(checkpoint) / "config.toml"
    if run_config.is_file():
        _copy(run_config, out / RUN_CONFIG_FILE)
        files.append(RUN_CONFIG_FILE)
    if meta.get("tokenizer_sha256"):
        config[TOKENIZER_KEY] = {"name": meta.get("tokenizer", ""), "sha256": meta["tokenizer_sha256"]}
        source = _tokenizer_source(run_config, meta["tokenizer_sha256"])
        if source is not None:
            name = "tokenizer.json" if source.suffix == ".json" else "tiktoken.model"
            _copy(source, out / name)
            config[TOKENIZER_KEY]["file"] = name
            files.append(name)
    config[EXPORT_KEY] = {"version": EXPORT_VERSION, "step": meta["step"],
                          "tokens_seen": (meta.get("train") or {}).get("tokens_seen"),
                          "run_config": RUN_CONFIG_FILE if RUN_CONFIG_FILE in files else None}
    config_text = json.dumps(config, indent=2) + "\n"
    # NOTE: config.json comes last (its presence marks a whole export), so its CRC is taken from the text, not the file.
    _write_checksums(out, files, config_text.encode())
    tmp = out / (CONFIG_FILE + ".tmp")
    tmp.write_text(config_text)
    os.replace(tmp, out / CONFIG_FILE)
    # NOTE: safetensors writes each shard through a private (0600) temporary file; the shards get the mode the
    # process gives its other files (config.json's), so whoever can read the config can read the weights.
    mode = (out / CONFIG_FILE).stat().st_mode & 0o777
    for name in written:
        os.chmod(out / name, mode)
    # NOTE: an earlier export into `out` with another shard count left shards this index does not name; loaders
    # that glob *.safetensors would read their stale tensors too.
    for stale in out.glob("model-*-of-*.safetensors"):
        if _SHARD_NAME.fullmatch(stale.name) and stale.name not in written:
            stale.unlink()
    # NOTE: likewise its tokenizer (another model's, which tools reading tokenizer.json would take) and run config.
    for stale in earlier - set(files):
        (out / stale).unlink(missing_ok=True)
    return index


def _remove_partial(out: Path, created: bool, n_shards: int) -> None:
    """What an export stopped midway wrote into `out`: all of `out` if the export created it, else its shards of this
    shard count, the index, checksums and temporary files; nothing once its config.json, written last, is there."""
    import shutil

    if (out / CONFIG_FILE).exists():
        return  # written last: the export is whole, whatever failed after it
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir():
        ours = (path.name in (INDEX_FILE, integrity.CHECKSUMS_FILE) or path.name.endswith(".tmp")
                or path.name.startswith("model-") and path.name.endswith(f"-of-{n_shards:05d}.safetensors"))
        if ours and path.is_file():
            path.unlink(missing_ok=True)


def _earlier_export_files(path: Path) -> set[str]:
    """The tokenizer and run-config files an earlier export into the directory of config.json `path` wrote.

    An --out whose config.json is not a K3 export's (another model's, a project's) is refused: the export
    replaces config.json.
    """
    if not path.is_file():
        return set()
    try:
        config = json.loads(path.read_text())
        kind = config.get("model_type")
    except (OSError, ValueError, AttributeError):
        kind = "unreadable"
    if kind != "kimi_k3":
        raise ValueError(f"--out {str(path.parent)!r} holds a config.json that is not a K3 export's (model_type "
                         f"{kind!r}): the export would replace it; export to a directory of its own")
    names = {(config.get(TOKENIZER_KEY) or {}).get("file"), (config.get(EXPORT_KEY) or {}).get("run_config")}
    return {n for n in names if isinstance(n, str) and n in ("tokenizer.json", "tiktoken.model", RUN_CONFIG_FILE)}


def _tokenizer_source(run_config: Path, sha256: str) -> Path | None:
    """The tokenizer file of the run's data.tokenizer when it is still the one the checkpoint records, else None."""
    import tomli

    from titan_k3.data.corpus import cache_root, embedded_name
    from titan_k3.data.tokenizer import file_sha256

    try:
        spec = tomli.loads(run_config.read_text()).get("data", {}).get("tokenizer", "embedded")
    except (OSError, ValueError):
        return None
    # NOTE: the cached embedded tokenizer only: an export does not build the corpus.
    path = cache_root() / embedded_name() / "tokenizer.json" if spec == "embedded" else Path(spec)
    try:
        return path if path.is_file() and file_sha256(path) == sha256 else None
    except OSError:
        return None


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def _write_checksums(out: Path, files: list[str], config: bytes) -> None:
    """checksums.json over `files` of `out` and config.json's text `config` (not yet written)."""
    import zlib

    sizes = {name: (out / name).stat().st_size for name in files}
    blocks = integrity.blocks_of(sizes)
    crcs = dict(zip(blocks, integrity.hash_blocks(out, blocks)))
    sizes[CONFIG_FILE] = len(config)
    for i, start in enumerate(range(0, len(config), integrity.BLOCK_BYTES)):
        chunk = config[start:start + integrity.BLOCK_BYTES]
        crcs[integrity.Block(CONFIG_FILE, i, start, len(chunk))] = zlib.crc32(chunk)
    integrity.write(out, integrity.build(sizes, crcs))


def is_export_dir(path: Path) -> bool:
    """Whether `path` holds an export, whole or partial (a config.json, an index or a shard): a step dir has none."""
    path = Path(path)
    return path.is_dir() and ((path / CONFIG_FILE).exists() or (path / INDEX_FILE).exists()
                              or any(_SHARD_NAME.fullmatch(p.name) for p in path.glob("model-*.safetensors")))


def export_record(src: Path) -> dict:
    """config.json's EXPORT_KEY record ({} for a version-1 export); a missing or unreadable config.json is a
    ValueError naming it (an export writes it last, so without it the export is partial)."""
    path = Path(src) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"export {str(src)!r} is incomplete: no {CONFIG_FILE} (an export writes it last: this one "
                         "was stopped or damaged; export the checkpoint again)")
    record = _read_json(path).get(EXPORT_KEY) or {}
    if not isinstance(record, dict):
        raise ValueError(f"{path}: {EXPORT_KEY} is not an object")
    return record


def verify_export(src: Path, group=None) -> tuple[str | None, bool]:
    """(the first problem found, or None; whether `src` predates export checksums), as verify.verify for a step dir."""
    record = export_record(src)
    if int(record.get("version") or 1) < 2:
        return None, True
    return verify(Path(src), group)


def import_state_dict(src: Path) -> tuple[K3Args, dict[str, torch.Tensor]]:
    """(K3Args, {titan_k3 name: float32 tensor}) from an export directory."""
    from safetensors.torch import load_file

    src = Path(src)
    args = args_from_hf_config(_read_json(src / "config.json"))
    index = _read_json(src / INDEX_FILE)
    weights = {}
    for file in sorted(set(index["weight_map"].values())):
        weights.update(_read_shard(src / file, load_file))
    if weights.keys() != index["weight_map"].keys():
        missing = sorted(index["weight_map"].keys() - weights.keys())[:3]
        raise ValueError(f"{src}: the index lists tensors the shards lack, e.g. {missing}")
    return args, {k: v.to(torch.float32) for k, v in from_hf(weights, set(args.mla_layers)).items()}


def export_shapes(src: Path) -> dict[str, tuple[int, ...]]:
    """{titan_k3 name: shape} of an export directory from config.json and the safetensors headers (no tensor is read)."""
    src = Path(src)
    args = args_from_hf_config(_read_json(src / "config.json"))
    index = _read_json(src / INDEX_FILE)
    shapes = {}
    for file in sorted(set(index["weight_map"].values())):
        shapes.update(_read_shard(src / file, _header_tensors))
    return {k: tuple(v.shape) for k, v in from_hf(shapes, set(args.mla_layers)).items()}


def _header_tensors(path: str) -> dict[str, torch.Tensor]:
    """{name: meta tensor of its shape} from one shard's header."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable export file ({e})") from None


def _read_shard(path: Path, read) -> dict[str, torch.Tensor]:
    """read(str path) of one safetensors shard; a missing, truncated or corrupt one is a ValueError naming it."""
    from safetensors import SafetensorError

    try:
        return read(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors shard ({e})") from None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_k3.checkpoint.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="a checkpoint dir: RUN_DIR/checkpoints/step-N")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weight dtype (default bfloat16)")
    p.add_argument("--max-shard-mb", type=int, default=5120, help="largest safetensors shard, MiB (default 5120)")
    a = p.parse_args(argv)
    if a.max_shard_mb < 1:
        print(f"error: --max-shard-mb {a.max_shard_mb}: must be >= 1", file=sys.stderr)
        return 2
    try:
        index = export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, max_shard_bytes=a.max_shard_mb * 2**20)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing exported; what this export had written into {str(a.out)!r} is removed",
              file=sys.stderr)
        return 130
    files = sorted(set(index["weight_map"].values()))
    print(f"exported {a.checkpoint} -> {a.out}: {len(index['weight_map'])} tensors, "
          f"{index['metadata']['total_size'] / 2**20:.1f} MiB in {len(files)} file(s), {a.dtype}")
    config = json.loads((a.out / CONFIG_FILE).read_text())
    if config[EXPORT_KEY]["run_config"] is None:
        print(f"note: no run config.toml names the folder of {a.checkpoint}: the export holds no {RUN_CONFIG_FILE}, "
              "so its evaluation takes the default settings", file=sys.stderr)
    tokenizer = config.get(TOKENIZER_KEY)
    if tokenizer and "file" not in tokenizer:
        print(f"note: the tokenizer {tokenizer['name']!r} (sha256 {tokenizer['sha256'][:12]}...) was not found where "
              "the run's data.tokenizer points: the export records its name and hash only", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
