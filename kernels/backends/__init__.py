"""Backends: one module per backend, each implementing the Level-0 operations.

A backend module exposes

    NAME                       "cute" | "triton" | "torch"
    OPERATIONS                 the operations it has kernels for (dispatch skips it for the others)
    INPUT_DTYPES, STATE_DTYPES the q/k/v and state-pool dtypes it accepts
    availability(device)       -> None if usable on that torch.device, else the reason why not
    head_dims_error(K, V)      -> None if supported, else the reason why not
    prefill(recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices,
            has_initial_state, out, checkpoint_every, checkpoint_indices, **kwargs)
    decode(recipe, q, k, v, g, beta, *, state_pool, state_indices, out, **kwargs)
    verify(recipe, q, k, v, g, beta, *, protocol, state_pool, state_indices,
           num_accepted_tokens, intermediate_states, intermediate_indices, out, **kwargs)
    commit(recipe, *, protocol, state_pool, state_indices, num_accepted_tokens,
           intermediate_states, intermediate_indices, k, v, g, beta, **kwargs)

Inputs reach a backend validated and normalised by ``cula_serve.api`` (packed layouts, int32
indices, the ``Recipe`` of ``kernels.common.prep``); the shapes are documented on the torch
backend, which is the reference for all of them.
"""
