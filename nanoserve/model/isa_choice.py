"""The measured choice between instruction sets (native.py's `auto`), kept as JSON beside
the libraries (`isa-choice.json`), keyed by the CPU's model name, a digest of its flags and
XCR0, and the libraries' digests (a kernel change measures again). A corrupt file is
measured over, never trusted; one cache may serve several machines, each under its key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nanoserve.model import cpu

# native.py's logger: every line about the kernels, built, chosen or loaded, under one name
log = logging.getLogger("nanoserve.model.native")

# The file beside the libraries, and how much faster a narrower set must be to be taken
# over a wider one.
CHOICE_FILE = "isa-choice.json"
TIE = 0.03


def choice_key(facts: cpu.CpuFacts, libraries: Sequence[str]) -> str:
    """What a measured choice holds for: this CPU model, its flags and XCR0 (facts.digest),
    and these builds of the kernels (their file names carry their digests)."""
    kernels = hashlib.sha256(" ".join(sorted(libraries)).encode()).hexdigest()[:16]
    return f"{facts.model}|flags={facts.digest()}|kernels={kernels}"


def faster(seconds: Mapping[str, float], candidates: Sequence[str]) -> str:
    """The fastest of `candidates` (widest first) by `seconds`, where a narrower set must
    beat the one it displaces by more than TIE: within noise the wider set is kept."""
    best = candidates[0]
    for c in candidates[1:]:
        if seconds[c] < seconds[best] * (1 - TIE):
            best = c
    return best


def figures(ms: Mapping[str, float]) -> str:
    """Milliseconds by instruction set, as the log lines give them."""
    return ", ".join(f"{isa} {t:.2f} ms" for isa, t in ms.items())


def read_choice(path: Path, key: str, candidates: Sequence[str]
                ) -> tuple[str, dict[str, float]] | None:
    """The choice and figures cached for `key`, or None: none kept, or a file that does not
    hold one this process can run (corrupt, or written by another version)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("nanoserve's CPU kernels: %s unreadable (%s); measuring again", path, e)
        return None
    choices = data.get("choices") if isinstance(data, dict) else None
    entry = choices.get(key) if isinstance(choices, dict) else None
    if entry is None and isinstance(choices, dict):
        return None  # measured on other machines, or for other builds, only
    if not (isinstance(entry, dict) and _valid_entry(entry, candidates)):
        log.warning("nanoserve's CPU kernels: %s does not hold a choice this machine runs; "
                    "measuring again", path)
        return None
    return entry["isa"], entry["ms"]


def _valid_entry(entry: dict[str, Any], candidates: Sequence[str]) -> bool:
    """Whether `entry` is {"isa": one of `candidates`, "ms": {set: milliseconds}}."""
    if entry.get("isa") not in candidates:
        return False
    ms = entry.get("ms")
    return isinstance(ms, dict) and all(
        isinstance(t, int | float) and not isinstance(t, bool) for t in ms.values())


def write_choice(path: Path, key: str, chosen: str, ms: Mapping[str, float]) -> None:
    """Keep `chosen` under `key` in `path`, beside other machines' choices (a cache shared
    between machines), less this CPU's choices for other builds of the kernels (stale)."""
    try:
        data = json.loads(path.read_text())
        choices = data["choices"] if isinstance(data.get("choices"), dict) else {}
    except (OSError, ValueError, AttributeError, KeyError):
        choices = {}
    cpu_part = key.rpartition("|kernels=")[0]
    choices = {k: v for k, v in choices.items() if k.rpartition("|kernels=")[0] != cpu_part}
    choices[key] = {"isa": chosen, "ms": dict(ms)}
    text = json.dumps({"version": 1, "choices": choices}, indent=1, sort_keys=True)
    try:
        _replace_text(path, text)
    except OSError as e:  # a read-only cache: the next process measures again
        log.warning("nanoserve's CPU kernels: cannot keep the measured choice in %s: %s",
                    path, e)


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` under a temporary name and rename it into place: a reader
    never sees half a file, and two writers cost one of them its entry, never the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
