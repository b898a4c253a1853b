#!/usr/bin/env bash
# llama.cpp's llama-server, llama-bench and llama-batched-bench, built from the llama.cpp that
# the llama-cpp-python sdist on PyPI vendors (the only way to its source here: no network
# but the package registries). Built once per version and CPU (-march=native code runs only
# where it was built) into the cache, which holds the binaries alone; prints their folder.
set -euo pipefail
version=${LLAMACPP_PYTHON_VERSION:-0.3.36}
py=${PYTHON:-.venv/bin/python}
flags=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
out="${NANOSERVE_CACHE:-$HOME/.cache/nanoserve}/llamacpp-$version-$flags"
if [ -x "$out/llama-bench" ] && [ -x "$out/llama-server" ] && [ -x "$out/llama-batched-bench" ]; then
  echo "$out"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building llama.cpp (llama-cpp-python $version) into $out: a long while on 2 cores" >&2
"$py" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
  "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$work/build" -j "$(nproc)" --target llama-server llama-bench llama-batched-bench >&2
mkdir -p "$out.tmp"
cp "$work"/build/bin/llama-server "$work"/build/bin/llama-bench "$work"/build/bin/llama-batched-bench "$out.tmp/"
rm -rf "$out" && mv "$out.tmp" "$out"
echo "$out"
