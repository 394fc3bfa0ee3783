#!/usr/bin/env bash
# llama.cpp for the benchmark's peers, built for this CPU as its users build it: the llama.cpp
# that llama-cpp-python 0.3.36 vendors, natively (GGML_NATIVE) -- except AMX. On CPUs with AMX
# (Sapphire Rapids and later) that build crashes: ggml_backend_amx_mul_mat segfaults on any
# prompt of more than one token (seen with llama-bench -p 5 and with llama-cpp-python's own
# native build; backtrace in bench/README.md). There the same ISA extensions are enabled one by
# one instead, AMX left out, which is the fastest build of it that works.
#
#   bash bench/llamacpp.sh [DIR]   native tools into DIR/build/bin (llama-bench, llama-speculative,
#                                  llama-lookup, llama-perplexity, llama-server; about 6 minutes on
#                                  2 cores) and
#                                  llama-cpp-python built the same way into the active Python.
# Prints the folder that holds the tools.
set -euo pipefail
version=0.3.36
dir=${1:-$HOME/.cache/llamacpp-peer}
flags=(-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF)
cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $cpu " == *" $1 "* ]]; }
if has amx_int8; then
  flags+=(-DGGML_NATIVE=OFF)
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512_vbmi:AVX512_VBMI \
              avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    has "${pair%%:*}" && flags+=("-DGGML_${pair##*:}=ON")
  done
else
  flags+=(-DGGML_NATIVE=ON)
fi
bin="$dir/build/bin"
stamp="$dir/build/flags"
if [ ! -x "$bin/llama-lookup" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${flags[*]}" ]; then
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir" >&2
  rm -rf "$dir/src" && mkdir "$dir/src"
  tar xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir/src" --strip-components=1
  (cd "$dir/src/vendor/llama.cpp" && cmake -B "$dir/build" -G Ninja "${flags[@]}" >/dev/null &&
   cmake --build "$dir/build" -j"$(nproc)" --target llama-bench llama-speculative llama-lookup llama-perplexity llama-server >/dev/null)
  echo "${flags[*]}" > "$stamp"
fi
if ! python -c "import llama_cpp" 2>/dev/null || [ "$(cat "$dir/python-flags" 2>/dev/null)" != "${flags[*]}" ]; then
  CMAKE_ARGS="${flags[*]}" python -m pip install -q --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$version" >&2
  python -m pip install -q "llama-cpp-python==$version" >&2  # its dependencies (the build above skipped them)
  echo "${flags[*]}" > "$dir/python-flags"
fi
# The OpenAI server's dependencies (python -m llama_cpp.server, the serving benchmark's peer).
python -c "import llama_cpp.server.app" 2>/dev/null || python -m pip install -q "llama-cpp-python[server]==$version" >&2
echo "$bin"
