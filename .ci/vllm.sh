#!/usr/bin/env bash
# CI: the vLLM plugin's tests against the real vLLM package, on the CPU, in their own virtual
# environment (.venv-vllm in the repository root, kept apart from the main one: vLLM pins its own
# dependency set). About 8 minutes of installing and 4 of testing on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
py=.venv-vllm/bin/python

pip_install() {
    # This machine's pip configuration names package folders that may be absent; pip warns for
    # each on every lookup. Keep the rest of the output.
    "$py" -m pip install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }
}

python3 -m venv .venv-vllm
# torch first, so that vLLM's torch==2.13.0 is the CPU build already on disk.
pip_install torch==2.13.0
# vLLM 0.33 pins torch 2.14 and does not resolve from the package index here; 0.32 is the
# supported version CI can install (the plugin supports both: cula-serve[vllm]).
pip_install 'vllm>=0.32,<0.33'
# vLLM's torchvision, torchaudio and torchcodec wheels are CUDA builds whose native libraries
# fail to load beside the CPU torch, and transformers and vLLM import them when present. Nothing
# here uses them.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec
# cula-serve with its test extra; the extra's triton (<3.7) replaces vLLM's 3.9, whose
# interpreter cannot run vLLM's Triton convolution kernels on the CPU.
pip_install -e '.[test]'
echo "installed in $((SECONDS - start)) s"
# The pytest script, not `python -m pytest`: the checkout's root stays off sys.path, so the
# installed distribution (with its vllm.general_plugins entry point) is what Python sees.
.venv-vllm/bin/pytest -q tests/plugin_vllm
echo "installed and tested in $((SECONDS - start)) s"
