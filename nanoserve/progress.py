"""Progress bars for long offline work: `LLM.generate`, `nanoserve bench`, `sim profile`,
`sim capacity`, `sim validate`.

tqdm on stderr, shown only when stderr is a terminal (tqdm's `disable=None`), so logs, pipes
and CI stay clean; `--quiet` on the command lines and `use_tqdm=False` on `LLM.generate`
(vLLM's name) turn it off on a terminal too. A bar reads no clock the work depends on and
changes nothing it measures: it is drawn at most ten times a second.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def bar(total: int, desc: str, *, enabled: bool = True, unit: str = "it") -> tqdm[Any]:
    """A bar to `update()` and `close()`; a no-op object off a terminal or when disabled."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.1, disable=None if enabled else True)


class LabelledProgress:
    """A `progress(label, done, total)` callback drawn as one bar per label, for work that
    runs in named parts (a capacity sweep's points)."""

    def __init__(self, *, enabled: bool = True, unit: str = "it") -> None:
        self.enabled = enabled
        self.unit = unit
        self._bar: tqdm[Any] | None = None
        self._label = ""

    def __call__(self, label: str, done: int, total: int) -> None:
        if self._bar is None or label != self._label:
            self.close()
            self._bar = bar(total, label, enabled=self.enabled, unit=self.unit)
            self._label = label
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
