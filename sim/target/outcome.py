"""A check's verdict and the report that gathers them: a readable table and JSON.

Every check ends in one of three words: `pass`, `fail` (with the requests and what came back,
so a reader can judge the server without rerunning anything) or `unsupported` (the server
lacks what the check needs: metrics, logprobs, a tokenizer route). The exit status is 1
where any check failed, so the report can gate a deployment.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "unsupported"]


@dataclass(frozen=True, slots=True)
class Outcome:
    check: str
    status: Status
    detail: str  # one line: what was measured, or why it could not be
    evidence: tuple[dict[str, Any], ...] = ()


def verdict(check: str, failures: list[dict[str, Any]], passed: str, failed: str) -> Outcome:
    """pass with `passed`, or fail with `failed` and the failures as evidence."""
    if failures:
        return Outcome(check, "fail", failed, tuple(failures))
    return Outcome(check, "pass", passed)


@dataclass(slots=True)
class Report:
    target: str
    identity: dict[str, Any]
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(o.status == "fail" for o in self.outcomes)

    def as_json(self) -> dict[str, Any]:
        return {"target": self.target, "identity": self.identity,
                "checks": [asdict(o) for o in self.outcomes],
                "failed": self.failed}

    def table(self) -> str:
        """The readable report: who answered, then one row per check, then each fail's
        first piece of evidence."""
        ident = ", ".join(f"{k} {v}" for k, v in self.identity.items())
        width = max([len(o.check) for o in self.outcomes] + [5])
        lines = [f"target {self.target} ({ident})", "",
                 f"{'check':<{width}}  {'result':<11}  detail"]
        lines += [f"{o.check:<{width}}  {o.status:<11}  {o.detail}" for o in self.outcomes]
        for o in self.outcomes:
            if o.status == "fail" and o.evidence:
                lines += ["", f"{o.check}: {len(o.evidence)} failing, the first:",
                          json.dumps(o.evidence[0], ensure_ascii=False, indent=1)[:2000]]
        return printable("\n".join(lines))

    def dumps(self) -> str:
        return printable(json.dumps(self.as_json(), ensure_ascii=False, indent=1))


def printable(text: str) -> str:
    """`text` with any lone surrogate (a split character's evidence) escaped, so that it can
    be printed and written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
