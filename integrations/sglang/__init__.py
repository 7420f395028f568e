"""SGLang plugin: ``--attention-backend cula`` and ``--linear-attn-backend cula``.

Installed with ``pip install cula-serve[sglang]``; SGLang finds it through the entry point
``cula = cula_serve.integrations.sglang.plugin:register`` in the ``sglang.srt.plugins`` group.

- ``translate``: SGLang's metadata and ``MambaPool`` tensors -> Level-1 calls. Imports nothing from
  SGLang, so the layer-level path runs (and is tested) where SGLang is not installed.
- ``kernels``, ``backend``, ``plugin``: the SGLang-facing glue; they import SGLang.
"""
