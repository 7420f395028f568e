"""Engine integrations, importable as ``cula_serve.integrations``.

The vLLM (``vllm.general_plugins``) and SGLang (``sglang.srt.plugins``) plugins live in
subpackages of this folder; none is part of this release yet.
"""
