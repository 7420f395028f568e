"""What ``--attention-backend cula`` resolves to when the installed vLLM is not supported: any
attribute read (vLLM resolving the backend class) raises the version error."""
from __future__ import annotations

from .compat import check_vllm_version


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    import vllm

    check_vllm_version(vllm.__version__)
    raise AttributeError(name)
