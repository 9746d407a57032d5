"""Writing output files: checked before the work that fills them, written whole or not at all.

``check_output`` finds out before a long computation that its result could not be written (no
such folder, a directory in the way, a read-only place); ``replace_file`` writes a new file
beside the target and renames it over it, so a full disk or a crash leaves the old file (or
none), never a truncated one that looks complete.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output(path: str | Path, what: str = "--output") -> Path:
    """``path`` as a ``Path``; ``OSError`` naming ``what`` unless a file could be written there
    (its folder exists and is writable, and it is not a directory). A full disk is found out
    only when writing."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise OSError(f"{what}: no such folder: {folder}")
    if path.is_dir():
        raise OSError(f"{what}: {path} is a directory")
    # The rename of ``replace_file`` needs the folder writable, whether or not the file exists.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{what}: cannot write into {folder} (permission denied or a read-only file system)")
    return path


def replace_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a new file beside ``path`` and rename it over ``path`` (atomic: a crash
    leaves the old file or the new one, never a part of either); an existing file's mode is kept."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), os.stat(path).st_mode & 0o777 if path.exists() else 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
