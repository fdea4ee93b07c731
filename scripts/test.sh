#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine (or bring it up to date), then run the
# linter and the whole test suite. The README's test command; CI runs it as it stands.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Mooncake's transfer engine links libibverbs even for TCP transfers (Debian: libibverbs1).
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libibverbs1 >/dev/null
fi

# The tests' own venv (about 4 GB: torch, vLLM's CPU build, SGLang, Mooncake), apart from the
# quick start's demo venv (.venv), so that neither install replaces the other's hicache.
[ -x .venv-test/bin/python ] || python3 -m venv .venv-test
. .venv-test/bin/activate
pip install -q torch==2.13.0 -e ".[test,mooncake,plot,crypto]"   # the CPU torch where the index has it
# The vLLM user's install, as docs/vllm.md gives it, line for line (tests/test_vllm_docs.py
# checks): vLLM pulls torchvision, torchaudio and torchcodec built for another torch, which
# nothing here needs and torchvision fails to import beside this one, hence the last line.
pip install torch==2.13.0
pip install -e '.[vllm,mooncake]'
pip uninstall -y torchvision torchaudio torchcodec
# SGLang for its storage backend's tests, as docs/sglang.md gives it (tests/test_sglang_docs.py
# checks): its storage path beside this torch, without its pins (torch 2.14.1 among them), and
# the few modules it imports that vLLM's install lacks.
pip install --no-deps sglang==0.5.23
pip install orjson ipython gguf

# The suite also runs with fewer extras (pip install -e '.[test]', with any of mooncake, vllm,
# plot and SGLang's lines above): a test that needs a missing one skips, or fails where
# HICACHE_REQUIRE_<EXTRA>=1, as here for everything installed above (tests/extras.py).
export HICACHE_REQUIRE_MOONCAKE=1 HICACHE_REQUIRE_VLLM=1 HICACHE_REQUIRE_PLOT=1
export HICACHE_REQUIRE_SGLANG=1
# Two pytest-xdist workers, a test file to a worker (a file's module fixtures, such as its vLLM
# runs, start once), in the order tests/conftest.py gives them (the slow files first): most of
# the suite's time is spent waiting for processes and servers to start.
ruff check . && python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
