"""Atomic file writes: a reader sees the old file or the complete new one, never a part.

Write to a temporary file in the same directory, flush and fsync it, then ``os.replace``
it over the target (atomic on POSIX file systems). The temporary file is named
``.<name>.<random>.tmp`` (:data:`TEMP_FILE`); a killed process can leave one behind, and
:func:`remove_stale_temp_files` clears them.

A full device (``ENOSPC``, or a write that stores fewer bytes than asked, also when a
writer such as ``torch.save`` turns it into a ``RuntimeError``) raises
:class:`NoSpaceError`, an ``OSError`` with errno ``ENOSPC`` whose message names the file
and the free space left.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_FILE = re.compile(r"\.(?P<target>.+)\.[A-Za-z0-9_]+\.tmp")
"""Names of the temporary files :func:`atomic_open` writes (``.train-00003.npy.k2j_x9a1.tmp``)."""

# numpy's ``tofile`` reports a short fwrite without an errno.
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


class NoSpaceError(OSError):
    """The device filled up while writing a file (errno ``ENOSPC``); the message names it."""


def free_space(path: str | Path) -> str:
    """``12.3 MB free on /mount`` for the file system holding ``path`` (or its nearest
    existing parent); ``free space unknown`` when it cannot be asked."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "free space unknown"
    return f"{free / 1e6:.1f} MB free on {_mount_point(where)}"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def no_space_error(path: str | Path) -> NoSpaceError:
    return NoSpaceError(
        errno.ENOSPC, f"no space left on device while writing {path} ({free_space(path)})"
    )


def _is_no_space(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised while handling: torch's zip writer turns
    a failed write into ``RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos``) is a full device."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, NoSpaceError):
            return False  # already names its file
        if isinstance(err, OSError) and (
            err.errno == errno.ENOSPC or (err.errno is None and bool(_SHORT_WRITE.search(str(err))))
        ):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; renamed over ``path`` on success,
    removed on error. A full device raises :class:`NoSpaceError` naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give files the usual mode
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError | RuntimeError) and _is_no_space(err):
            raise no_space_error(path) from err
        raise


class CheckedWriter:
    """A binary file wrapper whose ``write`` raises on a short write and keeps the sha256
    and byte count of what was written. It is not a real file object, so ``np.save``
    writes through ``write`` (numpy's ``tofile`` loses the errno of a failed write)."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._f.write(view)
        if written is not None and written != len(view):
            raise OSError(errno.ENOSPC, f"short write: {written} of {len(view)} bytes")
        self.digest.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()


def remove_stale_temp_files(directory: str | Path, recursive: bool = False) -> int:
    """Delete the temporary files of :func:`atomic_open` left in ``directory`` by a killed
    process (files matching :data:`TEMP_FILE` only); returns how many were removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed = 0
    for p in directory.rglob(".*.tmp") if recursive else directory.glob(".*.tmp"):
        if TEMP_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        CheckedWriter(f).write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically; returns the path written."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
    return Path(path)


def read_json_object(
    path: str | Path,
    missing: str | None,
    fix: str | None = None,
    unreadable: type[ValueError] = ValueError,
) -> dict | None:
    """The JSON object stored in ``path``, for the readers of a stage's outputs.

    A missing file raises ``FileNotFoundError("<path> is missing: <missing>")``, or returns
    None when ``missing`` is None (a file that may not exist yet). A damaged one (not UTF-8,
    not JSON, not an object) raises ``unreadable("<path> unreadable: <why>[; <fix>]")``.
    """
    path = Path(path)
    suffix = "" if fix is None else f"; {fix}"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if missing is None:
            return None
        raise FileNotFoundError(f"{path} is missing: {missing}") from None
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError included
        raise unreadable(f"{path} unreadable: {err}{suffix}") from None
    if not isinstance(data, dict):
        raise unreadable(f"{path} unreadable: holds a {type(data).__name__}, not an object{suffix}")
    return data


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
