"""`sim`: the simulator's command line (replay, load, capacity land in later issues)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sim")
    p.add_subparsers(dest="cmd")
    a = p.parse_args(argv)
    if a.cmd is None:
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
