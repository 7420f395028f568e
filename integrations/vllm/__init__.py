"""The vLLM plugin: ``vllm serve <hybrid model> --attention-backend cula``.

Installed with ``pip install 'cula-serve[vllm]'``; vLLM loads it in every process through the
``vllm.general_plugins`` entry point ``cula = cula_serve.integrations.vllm.plugin:register``.
With ``--attention-backend cula`` the model's full-attention layers keep the backend vLLM picks
for them, and its GDN layers (Qwen3-Next, Qwen3.5), KDA layers (Kimi-Linear) and Lightning
layers (Ling / Ring 2.5 ``BailingMoeV2_5ForCausalLM``; vLLM's MiniMax layer for out-of-tree
models) run their prefill, decode and speculative verify on cula-serve, over vLLM's own state
pages, with tensor parallelism serving each rank's heads. Without the flag nothing changes.

Modules:
    translate   vLLM batch metadata -> cula-serve calls (does not import vLLM)
    compat      supported vLLM versions, models and layer shapes (does not import vLLM)
    plugin      the entry point: registers the ``cula`` backend name and the layers (imports vLLM)
    metadata    the metadata builders that plan each batch once for all layers (imports vLLM)
    layers      the GDN, KDA and Lightning layers that call cula-serve (imports vLLM)

Options (``--additional-config``): ``{"cula_backend": "triton"}`` forces a cula-serve backend
by name (default: cula-serve's dispatch for the device).
"""
