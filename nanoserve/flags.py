"""What every command line shares: a parser whose errors are one line, and argparse types
that refuse a bad value by the range it must be in.

Each command judges its flags in one place, in two passes: the types below, as argparse
reads each flag (a port past 65535, a NaN timeout, a seed past 64 bits, an output file in a
folder that does not exist), then the command's own checks of what needs the model or the
machine (a device torch cannot use, a KV pool bigger than memory, a port in use), before it
loads a weight or binds a socket. Either way the user reads one line that names the flag,
and the exit status is 2, argparse's own.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


class Parser(argparse.ArgumentParser):
    """argparse's parser, with an error in one line (`prog: error: message`, exit 2), as
    nanoserve's own configuration errors are: the usage block argparse prints first pushed
    the line that says what is wrong out of a terminal's view and out of a log's last line.
    `--help` still prints the usage. Subparsers are built from the parent's class, so they
    inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    # NaN compares false with every bound, so a range check alone would let it through.
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_range(low: int, high: int | None = None, what: str = "an integer"
              ) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when `high` is None)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, got {value}")
        return value

    return parse


port = int_range(0, 65535, "a port number")
positive_int = int_range(1)
non_negative_int = int_range(0)
# Seeds: vLLM's range, and what a seed turns into everywhere (mix64, torch's generators).
int64 = int_range(INT64_MIN, INT64_MAX, "a 64-bit signed integer")
# A server's or a run's own seed: never negative, since elsewhere (llama.cpp's --seed -1)
# a negative seed means "pick one at random", and here it would fix one silently.
seed = int_range(0, INT64_MAX, "a seed: an integer")


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of something, in [0, 1)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1, got {text}")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def json_str_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM takes `--allowed-origins '["https://a.example"]'`."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def input_file(text: str) -> str:
    """An existing file (not a folder), read later."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return text


def output_file(text: str) -> str:
    """A file to write later: its folder must exist and the path must not be a folder, so a
    typo is refused now rather than after the work whose result it would hold."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {folder}")
    return text


def size_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB, 1000000)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:  # every size flag sizes something that must hold at least a byte
        raise argparse.ArgumentTypeError(f"must be a size > 0, got {text!r}")
    return size

