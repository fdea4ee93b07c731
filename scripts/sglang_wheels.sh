#!/usr/bin/env bash
# Download into DIR (default .whl) the wheels that run bench/sglang.py on the GPU machine, whose
# image has Python 3.12, torch, numpy, transformers (and what it pulls), tokenizers,
# safetensors, sentencepiece, tiktoken, triton and pydantic, but no package index: SGLang
# itself (its storage path; its pins left out, as in scripts/test.sh) and the small packages
# its import path needs that the image lacks, each without its dependencies (all of them are
# listed). SGLang's wheel is repacked without its compiled Rust extensions (its HTTP server's,
# gRPC's, benchmark's and multimodal ones, and the Rust radix tree: about 45 MB that its storage
# path never imports), which keeps the whole under 50 MiB. Then, on that machine, from the
# repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
mkdir -p "$dir"
wheels=(
  sglang==0.5.23
  orjson psutil pybase64 pillow starlette msgspec pyzmq gguf dill loguru compressed-tensors
  apache-tvm-ffi==0.1.11
  ipython traitlets pygments
  aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache attrs
  zstandard pyyaml prometheus-client
)
python3 -m pip download -q --no-deps --only-binary=:all: --dest "$dir" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "${wheels[@]}"
python3 - "$dir"/sglang-*.whl <<'PY'
import sys, zipfile
path = sys.argv[1]
drop = ("sglang/srt/rust_extensions/", "sglang/srt/mem_cache/rust_tree_core/")
with zipfile.ZipFile(path) as src:
    items = [(i, src.read(i)) for i in src.infolist()]
kept = [(i, data) for i, data in items if not (i.filename.startswith(drop) and i.filename.endswith(".so"))]
gone = {i.filename for i, _ in items} - {i.filename for i, _ in kept}
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
    for info, data in kept:
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if line.split(",", 1)[0] not in gone).encode()
        out.writestr(info, data)
print(f"{path}: {len(gone)} Rust extensions left out")
PY
du -ch "$dir"/*.whl | tail -1
