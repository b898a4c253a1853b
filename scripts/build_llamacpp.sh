#!/usr/bin/env bash
# llama.cpp's llama-server, llama-bench, llama-batched-bench and llama-quantize (which
# scripts/make_synthetic_gguf.py runs to make Q4_0 and Q4_K_M from F16), built from the
# llama.cpp that the llama-cpp-python sdist on PyPI vendors (the only way to its source
# here: no network but the package registries), into the cache, which holds the binaries
# alone; prints their folder. `build_llamacpp.sh native` (the default) builds with
# -DGGML_NATIVE=ON, once per version and CPU (-march=native code runs only where it was
# built); `build_llamacpp.sh avx2` builds for AVX2 + FMA + F16C with AVX-512 off, once per
# version, so that llama.cpp's AVX2 figures can be measured on an AVX-512 host too, beside
# nanoserve forced to AVX2.
set -euo pipefail
isa=${1:-native}
version=${LLAMACPP_PYTHON_VERSION:-0.3.36}
py=${PYTHON:-.venv/bin/python}
case "$isa" in
  native)
    flags=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
    out="${NANOSERVE_CACHE:-$HOME/.cache/nanoserve}/llamacpp-$version-$flags"
    cmake_isa=(-DGGML_NATIVE=ON) ;;
  avx2)
    out="${NANOSERVE_CACHE:-$HOME/.cache/nanoserve}/llamacpp-$version-avx2"
    cmake_isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF
               -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "build_llamacpp.sh: ISA must be native or avx2, not $isa" >&2; exit 2 ;;
esac
targets=(llama-server llama-bench llama-batched-bench llama-quantize)
# A cache missing any of them (one made before llama-quantize joined) is built again.
built=1
for t in "${targets[@]}"; do [ -x "$out/$t" ] || built=0; done
if [ "$built" = 1 ]; then
  echo "$out"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building llama.cpp (llama-cpp-python $version, $isa) into $out: a long while on 2 cores" >&2
"$py" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
  "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  "${cmake_isa[@]}" -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$work/build" -j "$(nproc)" --target "${targets[@]}" >&2
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
for t in "${targets[@]}"; do cp "$work/build/bin/$t" "$out.tmp/"; done
rm -rf "$out" && mv "$out.tmp" "$out"
echo "$out"
