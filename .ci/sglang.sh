#!/usr/bin/env bash
# CI for the SGLang plugin: its own venv (.venv-sglang), SGLang 0.5.23 without its GPU-only
# dependencies, cula-serve, then `pytest -q tests/plugin_sglang` on the CPU.
#
# Why not `pip install sglang==0.5.23`: it resolves 207 packages with a CUDA 13 stack (FlashInfer,
# sglang-kernel, cutlass-dsl, DeepEP, ...) that a CPU machine cannot use. SGLang's Python modules
# the plugin touches need only its pure-Python dependencies, plus torch and torchvision (imported
# by sglang.srt.configs). PyPI's torchvision wheels need PyPI's (CUDA) torch build: with the CPU
# build its C++ ops fail to load and `import torchvision` raises. So this installs SGLang's own
# pins torch==2.14.1 / torchvision==0.29.1 from PyPI (they run on the CPU), then SGLang with
# --no-deps, then the pure-Python dependencies at SGLang's pins where it pins them.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-sglang
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# PyPI's torch, not a local CPU build a machine-wide find-links may prefer (same version string).
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}" torch==2.14.1 torchvision==0.29.1
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" numpy pytest hypothesis orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq \
    tqdm IPython aiohttp dill einops gguf partial_json_parser uvicorn fastapi apache-tvm-ffi==0.1.11 \
    compressed-tensors==0.18.0 openai==2.8.0 transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1
# torch 2.14.1 brings its own triton; cula-serve's CPU path here is the torch backend.
"${pip[@]}" --no-deps --no-build-isolation -e .
"$venv/bin/pytest" -q tests/plugin_sglang  # not `python -m`: the repo root must not shadow the installed metadata
