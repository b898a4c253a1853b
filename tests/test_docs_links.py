"""Every file, test path and link that README.md and docs/*.md name exists.

Three kinds of reference are checked, in each page outside fenced code unless said:

- markdown links `[text](path#anchor)`: the path relative to the page (a bare `#anchor` is
  the page itself), and the anchor against the target's headings by GitHub's slug rule;
- backticked tokens that look like repository paths: a `/` in them, and a file suffix
  below or a trailing `/` (a directory);
- paths written out in plain text or in fenced code that start at a top-level folder
  (`tests/server/test_fleet.py`, `sim/costs/smollm2-cpu.json`).

A path whose first part is a top-level entry of the repository must exist as written. A
shorter one (`server/jobs.py`, `csrc/`, as the pages write paths inside a package) must be
the tail of some path in the tree. Skipped: URLs, `~` and `/tmp` paths, `../shared/...`,
and placeholders (FILE, PATH, <, >, {). A glob (`tests/server/test_faults*.py`) must match
something.
"""

from __future__ import annotations

import os
import re
from fnmatch import fnmatchcase as fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".sh", ".jsonl", ".json", ".toml", ".txt", ".cpp", ".h", ".csv")
PRUNE = {".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".ruff_cache"}
PLACEHOLDERS = ("FILE", "PATH", "<", ">", "{", "...")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
TOP = sorted(
    p.name for p in ROOT.iterdir() if p.name not in PRUNE and not p.name.endswith(".egg-info")
)
ROOTED = re.compile(
    r"(?<![\w./~$-])(?:" + "|".join(re.escape(t) for t in TOP if "." not in t[1:]) + r")"
    r"/[\w./-]*"
)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tree() -> set[str]:
    """Every file and folder under the root, as posix paths relative to it."""
    found: set[str] = set()
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in PRUNE and not d.endswith(".egg-info")]
        rel = Path(here).relative_to(ROOT).as_posix()
        base = "" if rel == "." else rel + "/"
        found.update(base + name for name in dirs + files)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def skipped(token: str) -> bool:
    return (
        "://" in token
        or token.startswith(("~", "/", "../shared", "mailto:", "$"))
        or any(p in token for p in PLACEHOLDERS)
    )


def looks_like_path(token: str) -> bool:
    return "/" in token and (token.endswith(SUFFIXES) or token.endswith("/"))


def exists(path: str, files: set[str]) -> bool:
    path = path.removeprefix("./").rstrip("/")
    if path.split("/")[0] in TOP:
        return path in files or ("*" in path and any(ROOT.glob(path)))
    return any(fnmatch(f, path) or fnmatch(f, "*/" + path) for f in files)


def problems(page: Path, files: set[str]) -> list[str]:
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    text = page.read_text()
    prose = FENCE.sub("", text)
    out: list[str] = []
    for target in LINK.findall(prose):
        if skipped(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{name}: link ({target}): {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{name}: link ({target}): no heading #{anchor} in {path or name}")
    tokens = [t for span in CODE.findall(prose) for t in span.split()]
    tokens += ROOTED.findall(CODE.sub("", LINK.sub("", prose))) + ROOTED.findall(
        "\n".join(m.group(0) for m in FENCE.finditer(text))
    )
    for token in tokens:
        token = token.lstrip("(\"'").rstrip(",;:.)'\"")
        if looks_like_path(token) and not skipped(token) and not exists(token, files):
            out.append(f"{name}: `{token}` does not exist")
    return out


def test_docs_name_only_what_exists() -> None:
    files = tree()
    found = [p for page in pages() for p in problems(page, files)]
    assert not found, "stale references:\n" + "\n".join(dict.fromkeys(found))


def test_slug_rule() -> None:
    assert slug("Batch-1 decode against llama.cpp, by CPU class") == (
        "batch-1-decode-against-llamacpp-by-cpu-class"
    )
    assert slug("Agents: tool calling, reasoning, the Responses API") == (
        "agents-tool-calling-reasoning-the-responses-api"
    )
    assert slug("`sim capacity` and [links](x.md)") == "sim-capacity-and-links"


def test_each_kind_of_stale_reference_is_named(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n[ok](#a-page) [gone](missing.md) [bad anchor](#no-such-heading)\n"
        "`engine/engine.py` `nanoserve/server/no_such.py` `tests/server/test_faults*.py`\n"
        "`tests/test_faults*.py` `engine/gone.py` `~/x/y.py` `../shared/z.py` `PATH/x.py`\n"
        "Plain text names tests/server/no_such_test.py too.\n"
        "```sh\n.venv/bin/sim replay traces/no_such.jsonl\n```\n"
    )
    found = problems(page, tree())
    assert found == [
        "page.md: link (missing.md): missing.md does not exist",
        "page.md: link (#no-such-heading): no heading #no-such-heading in page.md",
        "page.md: `nanoserve/server/no_such.py` does not exist",
        "page.md: `tests/test_faults*.py` does not exist",
        "page.md: `engine/gone.py` does not exist",
        "page.md: `tests/server/no_such_test.py` does not exist",
        "page.md: `traces/no_such.jsonl` does not exist",
    ]


def test_the_readme_is_a_front_page() -> None:
    # Issue 45: what the project is, the quick start, the API, the models, the links and the
    # layout in at most 200 lines; the details live in docs/, which its first screen names.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md is {len(lines)} lines: move the details to docs/"
    assert any("docs/ARCHITECTURE.md" in line for line in lines[:25])
