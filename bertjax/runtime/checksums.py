"""A finished checkpoint step's seal: the size and CRC32 of every file, recorded in
`<step>/bertjax_checksums.json` (`seal`) and compared before a restore (`verify`), so that a
truncated, deleted or bit-flipped file is found by name. Reads go through bertjax.runtime.files: a
file is "missing" only when the storage says so."""

from __future__ import annotations

import json
import zlib

from etils import epath

from bertjax.runtime import files as file_layer

CHECKSUMS = "bertjax_checksums.json"


def _files(directory: epath.Path) -> list[epath.Path]:
    found = []
    for path in directory.iterdir():
        found.extend(_files(path) if path.is_dir() else [path])
    return found


def _crc32(path: epath.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def seal(step_directory: str) -> None:
    """Writes `CHECKSUMS` into a finished checkpoint step: size and CRC32 of every file."""
    root = epath.Path(step_directory)
    sums = {
        str(p.relative_to(root)): [p.stat().length, _crc32(p)]
        for p in _files(root)
        if not p.name.startswith(CHECKSUMS)
    }  # (and a crashed write's temporary)
    file_layer.write_text(f"{step_directory.rstrip('/')}/{CHECKSUMS}", json.dumps({"crc32": sums}))


def verify(step_directory: str) -> tuple[bool, str | None]:
    """`(sealed, problem)` of one step directory: what differs from its recorded checksums
    (missing, resized or changed files), None if nothing does or nothing was recorded. A
    read that fails (storage.StorageUnavailable) raises: it proves nothing."""
    root = step_directory.rstrip("/")
    if not file_layer.exists(f"{root}/{CHECKSUMS}"):  # (raises if the storage cannot say)
        return False, None
    try:
        recorded = json.loads(file_layer.read_text(f"{root}/{CHECKSUMS}"))["crc32"]
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        return True, f"its {CHECKSUMS} is unreadable ({e})"
    problems = []
    for name, (size, crc) in sorted(recorded.items()):
        path = epath.Path(root) / name
        if not file_layer.exists(str(path)):
            problems.append(f"{name} is missing")
        elif file_layer.getsize(str(path)) != size:
            problems.append(f"{name} has {file_layer.getsize(str(path))} bytes, not {size}")
        elif _crc32(path) != crc:
            problems.append(f"{name} does not match its checksum")
    if not problems:
        return True, None
    return True, "; ".join(problems[:3]) + (
        f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    )
