"""Every file sim writes is written whole or not at all.

A trace rewritten by `--update`, a capacity report, a cost model, a benchmark's figures: a
reader (CI, a person, the next command) must never find half of one, which is what a kill,
a full disk or an exception mid-write used to leave under the final name. So each is
written to a temporary file in the same folder (a rename within one filesystem is atomic),
flushed to disk, then renamed over the final name; on any failure the temporary file goes
and the old file, if any, is still there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], *, newline: str | None = "\n",
                encoding: str = "utf-8") -> Iterator[IO[str]]:
    """A text file that appears at `path` only once the block has finished without error."""
    final = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # mkstemp makes it private; keep the usual mode
            os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def atomic_path(path: str | os.PathLike[str]) -> contextlib.AbstractContextManager[Path]:
    """For a writer that wants a path (matplotlib's savefig): a temporary path in the same
    folder, renamed to `path` when the block finishes without error."""
    return _atomic_path(Path(path))


@contextlib.contextmanager
def _atomic_path(final: Path) -> Iterator[Path]:
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=final.suffix, dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with contextlib.suppress(OSError):
            os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
