#!/usr/bin/env bash
# Installs llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`)
# once per version into a virtualenv under ~/.cache/agentrun/, from the same
# source distribution e2e/build-llama.sh builds llama.cpp from, for the tests
# that drive a run against a model server nobody here wrote
# (e2e/suites/tests/e2e_local_model_python.rs, through e2e/llama-python).
#
#   e2e/build-llama-python.sh [build|paths]
#     paths: print LLAMA_PYTHON=<the venv's python> and LLAMA_CPP_LIB_PATH=<libs>
#
# No second compile of llama.cpp: the package is installed with LLAMA_BUILD=OFF
# (its CMake project then builds nothing; seconds) and loads the shared
# libraries e2e/build-llama.sh built from the same vendored sources, through
# LLAMA_CPP_LIB_PATH (llama_cpp/llama_cpp.py reads it; without it the package
# looks in its own llama_cpp/lib, which stays empty). Same sources, so the same
# ABI; importing llama_cpp binds every function it declares, so `ready` below
# proves the symbols are there. Only libllama (and, by its rpath, libggml*) is
# loaded: libmtmd is for the multimodal chat handlers, not used here.
#
# Environment (all optional):
#   AGENTRUN_CACHE            cache root (default ~/.cache/agentrun)
#   LLAMA_CPP_PYTHON_VERSION  version (default 0.3.36, as e2e/build-llama.sh)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
export LLAMA_CPP_PYTHON_VERSION
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
# "-shared": bound to e2e/build-llama.sh's shared libraries. An older
# llama-cpp-python-server-VERSION venv (with its own compiled copy) is unused.
VENV="$CACHE/llama-cpp-python-server-$LLAMA_CPP_PYTHON_VERSION-shared-avx2"
DL="$CACHE/build/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION/dl"
BUILD_LOG="$CACHE/build/llama-cpp-python-server-$LLAMA_CPP_PYTHON_VERSION.log"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

log() { printf '[build] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

eval "$("$HERE/build-llama.sh" paths)" # LLAMA_LIB

ready() {
  [ -x "$VENV/bin/python" ] &&
    LLAMA_CPP_LIB_PATH="$LLAMA_LIB" "$VENV/bin/python" -c 'import llama_cpp.server.app' 2>/dev/null
}

case "${1:-build}" in
  paths) echo "LLAMA_PYTHON=$VENV/bin/python"; echo "LLAMA_CPP_LIB_PATH=$LLAMA_LIB"; exit 0 ;;
  build) ;;
  *) die "usage: $0 [build|paths]" ;;
esac

if ready; then log "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION server cached in $VENV"; exit 0; fi
t0=$SECONDS
# The libraries (and the sdist) first; cached, so cheap when e2e/test built them.
"$HERE/build-llama.sh" server
PYTHON="${PYTHON:-$(command -v python3)}" || die "python3 is required"
command -v cmake >/dev/null || die "cmake is required (llama-cpp-python's build runs it, to build nothing)"
sdist="$DL/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
[ -f "$sdist" ] || die "no $sdist (e2e/build-llama.sh downloads it)"
# Built in place (a venv is not relocatable); `ready` tells a finished one.
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
log "installing llama-cpp-python $LLAMA_CPP_PYTHON_VERSION[server] without its llama.cpp (LLAMA_BUILD=OFF)"
mkdir -p "$(dirname "$BUILD_LOG")"
CMAKE_ARGS="-DLLAMA_BUILD=OFF" \
  "$VENV/bin/pip" install --quiet "$sdist[server]" >"$BUILD_LOG" 2>&1 ||
  { tail -n 30 "$BUILD_LOG" >&2; die "pip install failed; read $BUILD_LOG"; }
if compgen -G "$VENV/lib/python3*/site-packages/llama_cpp/lib/*.so*" >/dev/null; then
  die "the package built its own llama.cpp after all (LLAMA_BUILD=OFF ignored?); read $BUILD_LOG"
fi
ready || {
  LLAMA_CPP_LIB_PATH="$LLAMA_LIB" "$VENV/bin/python" -c 'import llama_cpp.server.app' 2>&1 | tail -n 5 >&2
  die "the server does not import with LLAMA_CPP_LIB_PATH=$LLAMA_LIB"
}
log "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION server ready in $((SECONDS - t0)) s ($VENV)"
