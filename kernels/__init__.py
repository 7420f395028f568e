"""Level-0 kernels of cula-serve, importable as ``cula_serve.kernels``.

One folder per family or shared core, with the math beside the code that implements it:

- ``common/``      pieces every family shares: input preparation (gates, beta, l2norm).
- ``delta_rule/``  the gated delta rule (GDN = scalar gate, KDA = per-channel gate):
                   ``naive.py`` is the token-by-token oracle, ``chunk_torch.py`` the chunked WY form.
- ``lightning/``   linear attention with a constant per-head decay (MiniMax, Ling).
- ``backends/``    one module per backend; each implements the Level-0 operations
                   (``prefill``, ``decode``, ``verify``, ``commit``) that ``cula_serve.dispatch`` picks.
"""
