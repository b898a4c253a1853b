"""Six client frameworks against `nanoserve serve --model stub` on a real socket (issue 42):
the official `openai` client, openai-agents, langchain-openai with LangGraph, LiteLLM,
Pydantic AI and Instructor, each at the version tests/frameworks/*.txt pins.

Each framework runs as a script (tests/frameworks/fw_*.py) in an interpreter of its own kind,
as GuideLLM does: .venv/agents holds nanoserve's packages through a .pth file plus the
frameworks that agree with its openai and pydantic pins; .venv/instructor holds Instructor
with its own openai 2 (it needs openai<3). `just agents-setup` builds both, and `just test`
runs it first. One server serves every script; each script runs once, all its cases, and
prints a JSON line per case, which the test for that case reads.

Per framework: plain chat, streamed chat, a tool loop (the model calls get_weather, the
framework runs it and sends the result back, the model answers), structured output into a
pydantic model, and structured output with tools where the framework has it. The stub says
what the prompt scripts (at temperature 0), so every turn's output is known and asserted
exactly: the call's arguments, the tool's one run, the final text or model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from support.serve_process import serving

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "frameworks"
AGENTS, INSTRUCTOR = ".venv/agents/bin/python", ".venv/instructor/bin/python"
CASES = ("plain", "streamed", "tool_loop", "structured", "structured_with_tools")
# framework -> (interpreter, script, its cases)
FRAMEWORKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "openai": (AGENTS, "fw_openai.py", CASES),
    "openai-agents": (AGENTS, "fw_openai_agents.py",
                      tuple(f"{c}[{api}]" for api in ("chat", "responses") for c in CASES)),
    "langchain": (AGENTS, "fw_langchain.py", CASES),
    "litellm": (AGENTS, "fw_litellm.py", CASES),
    "pydantic-ai": (AGENTS, "fw_pydantic_ai.py",
                    tuple(f"{c}[{api}]" for api in ("chat", "responses") for c in CASES)),
    # Instructor runs no tools (it is structured output only): no tool loop.
    "instructor": (INSTRUCTOR, "fw_instructor.py",
                   ("plain", "streamed", "structured", "structured_with_tools")),
}
# Cases that fail because of nanoserve: (framework, case) -> the reason (none known).
XFAIL: dict[tuple[str, str], str] = {}

pytestmark = pytest.mark.skipif(
    not ((ROOT / AGENTS).exists() and (ROOT / INSTRUCTOR).exists()),
    reason=f"the frameworks are not installed at {AGENTS}, {INSTRUCTOR} "
           "(run `just agents-setup`)")


def client_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "OPENAI_API_KEY": "unused",  # some read it before they are given one
        "OPENAI_AGENTS_DISABLE_TRACING": "1",  # no trace export to OpenAI
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no cost-map fetch from GitHub
        "LANGSMITH_TRACING": "false", "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
    })
    return env


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`nanoserve serve --model stub` on a free port: its base URL once the engine is ready."""
    with serving(["--model", "stub"]) as url:
        yield f"{url}/v1"


class Runs:
    """Each framework's script, run once on first use: case -> its JSON line."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.lines: dict[str, dict[str, dict[str, Any]]] = {}
        self.stderr: dict[str, str] = {}

    def __call__(self, framework: str) -> dict[str, dict[str, Any]]:
        if framework not in self.lines:
            python, script, _ = FRAMEWORKS[framework]
            done = subprocess.run([str(ROOT / python), str(SCRIPTS / script), self.base_url],
                                  cwd=SCRIPTS, env=client_env(), capture_output=True,
                                  text=True, timeout=300, check=False)
            lines = [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]
            self.lines[framework] = {line["case"]: line for line in lines}
            self.stderr[framework] = f"exit {done.returncode}: {done.stderr[-3000:]}"
        return self.lines[framework]


@pytest.fixture(scope="module")
def runs(server: str) -> Runs:
    return Runs(server)


def params() -> list[Any]:
    return [pytest.param(fw, case, id=f"{fw}-{case}",
                         marks=[pytest.mark.xfail(reason=XFAIL[fw, case], strict=True)]
                         if (fw, case) in XFAIL else [])
            for fw, (_, _, cases) in FRAMEWORKS.items() for case in cases]


@pytest.mark.parametrize(("framework", "case"), params())
def test_framework_case(runs: Runs, framework: str, case: str) -> None:
    got = runs(framework)
    line = got.get(case)
    assert line is not None, f"{framework} did not report {case}: {runs.stderr[framework]}"
    assert line["ok"], f"{line['error']}\n{line['traceback']}"


@pytest.mark.parametrize(("python", "pins"), [(AGENTS, "agents.txt"),
                                              (INSTRUCTOR, "instructor.txt")])
def test_pinned_versions(python: str, pins: str) -> None:
    """Each interpreter runs what its file pins; .venv/agents runs nanoserve's openai."""
    wanted = dict(re.sub(r"\[.*\]", "", line).split("==")
                  for line in (SCRIPTS / pins).read_text().splitlines()
                  if line and not line.startswith("#"))
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(ROOT / python), "-c", code, *wanted], env=client_env(),
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == wanted
    if python == AGENTS:
        assert (wanted["openai"], wanted["pydantic"]) == (version("openai"), version("pydantic"))
