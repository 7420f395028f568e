"""Engine integrations, importable as ``cula_serve.integrations``.

- ``vllm``: the ``vllm.general_plugins`` entry point; ``--attention-backend cula`` routes GDN and
  KDA layers to cula-serve (``cula-serve[vllm]``). Tested against vLLM 0.32 on the CPU.
- ``sglang``: the ``sglang.srt.plugins`` entry point; ``--attention-backend cula`` and
  ``--linear-attn-backend cula`` (``cula-serve[sglang]``). Tested against SGLang 0.5.23 on the CPU.

Each keeps its translation from the engine's metadata to cula-serve calls in a module that does
not import the engine (``translate.py``), so that layer can be tested where the engine is absent.
"""
