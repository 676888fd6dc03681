"""Checksums of a checkpoint's files: written at save (`checksums.json`), checked before a load.

    checksums.json  {"version": 1, "algorithm": "crc32", "block_bytes": 67108864,
                     "files": {"__0_0.distcp": {"bytes": 1234, "crc32": ["1a2b3c4d", ...]}, ...}}

Every file of a step dir except checksums.json itself is listed with its size
and the CRC-32 of each 64 MiB block (the last one shorter). Blocks make the
work parallel: zlib releases the GIL, so threads hash blocks of one file at
once, and several ranks split the blocks between them. A listed file that is
missing, a size that differs (a truncated write) or a block whose CRC differs
makes the checkpoint damaged, and the problem names the file (and the block's
byte range). CRC-32 catches torn and overwritten bytes, not tampering.

Torch-free: the manager does the collectives (who hashes which blocks, and the
gather), these helpers only read and write files.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CHECKSUMS_FILE = "checksums.json"
VERSION = 1
BLOCK_BYTES = 64 << 20
_READ_BYTES = 1 << 20
# Enough threads to keep a fast disk busy; zlib's CRC runs at ~1 GB/s per core.
_THREADS = max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class Block:
    """Bytes [start, start + length) of `file`, the block number `index` of it."""

    file: str
    index: int
    start: int
    length: int

    def span(self) -> str:
        return f"bytes {self.start}-{self.start + self.length}"


def blocks_of(sizes: dict[str, int]) -> list[Block]:
    """The blocks of files {name: bytes}, in name order (an empty file has no block)."""
    out = []
    for name in sorted(sizes):
        for i, start in enumerate(range(0, sizes[name], BLOCK_BYTES)):
            out.append(Block(name, i, start, min(BLOCK_BYTES, sizes[name] - start)))
    return out


def share(blocks: list[Block], rank: int, world: int) -> list[Block]:
    """This rank's blocks (every world-th): the same split on every rank that sees the same list."""
    return blocks[rank::world]


def file_sizes(folder: Path) -> dict[str, int]:
    """{name: bytes} of the files a checksum covers: every regular file in `folder` but checksums.json."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir())
            if p.is_file() and p.name != CHECKSUMS_FILE}


def _crc_block(folder: Path, block: Block) -> int:
    crc = 0
    with open(folder / block.file, "rb") as f:
        f.seek(block.start)
        left = block.length
        while left > 0:
            chunk = f.read(min(_READ_BYTES, left))
            if not chunk:
                raise ValueError(f"{folder / block.file}: ends inside {block.span()} (truncated)")
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def hash_blocks(folder: Path, blocks: list[Block]) -> list[int]:
    """CRC-32 of each block, in order (threads: zlib hashes without the GIL)."""
    if len(blocks) <= 1:
        return [_crc_block(folder, b) for b in blocks]
    with ThreadPoolExecutor(min(_THREADS, len(blocks)), thread_name_prefix="crc32") as pool:
        return list(pool.map(lambda b: _crc_block(folder, b), blocks))


def build(sizes: dict[str, int], crcs: dict[Block, int]) -> dict:
    """The checksums.json document for files {name: bytes} and every block's CRC."""
    files = {}
    for name in sorted(sizes):
        mine = sorted((b for b in crcs if b.file == name), key=lambda b: b.index)
        files[name] = {"bytes": sizes[name], "crc32": [f"{crcs[b]:08x}" for b in mine]}
    return {"version": VERSION, "algorithm": "crc32", "block_bytes": BLOCK_BYTES, "files": files}


def write(folder: Path, document: dict) -> None:
    """Write checksums.json durably (temp name, fsync, rename)."""
    tmp = folder / f"{CHECKSUMS_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(document, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / CHECKSUMS_FILE)


def read(folder: Path) -> dict:
    """The checksums.json of step dir `folder`; ValueError naming the file when it is missing or unreadable."""
    path = folder / CHECKSUMS_FILE
    try:
        doc = json.loads(path.read_text())
        ok = doc.get("version") == VERSION and doc.get("algorithm") == "crc32" and isinstance(doc.get("files"), dict)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__})") from None
    if not ok:
        raise ValueError(f"{path}: not a version-{VERSION} crc32 checksum list")
    return doc


def expected_blocks(doc: dict) -> list[Block]:
    """The blocks checksums.json describes, in the order `blocks_of` gives."""
    return blocks_of({name: int(entry["bytes"]) for name, entry in doc["files"].items()})


def check_sizes(folder: Path, doc: dict) -> str | None:
    """The first listed file that is missing or of another size (cheap: no byte is read), or None."""
    for name, entry in sorted(doc["files"].items()):
        path = folder / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: {size} bytes, {entry['bytes']} when saved (truncated or overwritten)"
    return None


def check_blocks(folder: Path, doc: dict, blocks: list[Block]) -> str | None:
    """The first of `blocks` whose CRC differs from checksums.json, or None."""
    for block, crc in zip(blocks, hash_blocks(folder, blocks)):
        saved = doc["files"][block.file]["crc32"][block.index]
        if f"{crc:08x}" != saved:
            return f"{folder / block.file}: {block.span()} changed since the save (crc32 {crc:08x}, saved {saved})"
    return None
