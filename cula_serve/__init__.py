"""cula-serve: linear-attention kernels for LLM serving.

Level 1 (this package): ``cula_gdn``, ``cula_kda``, ``cula_lightning`` (prefill), ``cula_decode``,
``cula_verify`` + ``cula_commit`` (MTP), over a paged state pool (``StatePool``), dispatched to the
best backend for the device. Level 0 kernels live in ``cula_serve.kernels``.
"""
from .api import PendingCommit, cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify
from .dispatch import BackendUnavailableError
from .pool import StatePool, k_first_to_k_last, k_last_to_k_first
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "PendingCommit",
    "StatePool",
    "cula_commit",
    "cula_decode",
    "cula_gdn",
    "cula_kda",
    "cula_lightning",
    "cula_verify",
    "k_first_to_k_last",
    "k_last_to_k_first",
    "warmup",
]
