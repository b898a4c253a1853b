"""Every package's docstring maps every module and sub-package in it (issue 45): a file a
reader cannot find from its package's map is a file the map has lost. A module is named as
`name.py`, or as a map line's first word (`name   what it does`); a sub-package as `name/`.
Teeth: a new module in any package, or a rename, fails here until its map names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for top in ("nanoserve", "sim") for p in (ROOT / top).rglob(
    "__init__.py"))


def named(doc: str, name: str, package: bool) -> bool:
    e = re.escape(name)
    whole = e + ("/" if package else r"\.py")
    line = r"(?m)^\s*(?:[\w/.]+, )*" + e + ("/?" if package else "") + r"(?=[\s,]|$)"
    return bool(re.search(r"(?<![\w/.])" + whole, doc) or re.search(line, doc))


def unmapped(pkg: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    modules = [p.stem for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    subs = [p.name for p in pkg.iterdir() if (p / "__init__.py").exists()]
    return ([f"{m}.py" for m in sorted(modules) if not named(doc, m, False)]
            + [f"{s}/" for s in sorted(subs) if not named(doc, s, True)])


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_on_its_package_map(pkg: Path) -> None:
    assert unmapped(pkg) == []


def test_the_map_check_has_teeth() -> None:
    assert named("    stats.py  percentiles", "stats", False)
    assert named("    bench, llm    the offline benchmark", "llm", False)
    assert named("    target/      `sim replay --target`", "target", True)
    assert not named("real Llama weights and the stub", "weights", False)
