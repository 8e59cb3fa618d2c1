"""Megatron-FSDP's fsdp_dtensor checkpoints: every rank holds optimizer state for every parameter, in one order.

Megatron-FSDP shards each parameter group's flat buffer over the data-parallel-with-CP ranks, so a parameter can lie
wholly in other ranks' shards: this rank's DTensor shard of it is empty. Megatron-FSDP hands such a parameter no
gradient (``ParamAndGradBuffer.update_main_grads``: ``grad = None`` for an empty shard), and the optimizer creates
state only for parameters with a gradient (torch's AdamW lazily; Megatron's own ``DistributedOptimizer.
_init_optimizer_states_with_dummy_values``, used before a load, skips empty shards on purpose). The fsdp_dtensor
save and load then walk the optimizer state per parameter and make collective calls per DTensor on every rank
(``fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict``: two ``make_fsdp_dtensor`` per moment of each SwiGLU
``linear_fc1``; ``uneven_dtensor.preprocess_state_dict_for_uneven_dtensor``: an ``all_gather_object`` per DTensor):
a rank without the state of a parameter makes fewer calls, the ranks' collectives pair up different tensors and
``validate_uneven_dtensor`` asserts ("DTensor chunk metadata is invalid"), or the ranks hang.

``complete_fsdp_optimizer_state`` gives each such parameter the state the optimizer would hold for it: the same
keys as the rank's other parameters, moments shaped like the parameter (zero elements on this rank: nothing changes
in the optimizer step, which skips parameters without a gradient) and the same ``step`` as the others (a replicated
value in the checkpoint, which every rank must write alike). It also puts the state in the order of the parameter
groups, the same on every rank, so the per-DTensor collectives pair up the same tensors.

``keep_fsdp_optimizer_state_complete`` runs it after every step of the torch optimizer (torch's own
``Optimizer.register_step_post_hook``): after each training step (the ``step`` values stay equal, which Megatron's
``DistributedOptimizer.state_dict`` asserts without TE/Apex) and after the zero-gradient step with which Megatron
creates the state a load fills in (``_init_optimizer_states_with_dummy_values``), so a resume's state dict has every
parameter too. Nothing is rebound: the hook is torch's API for this.
"""

from __future__ import annotations

import weakref
from typing import Any, List

_HOOKED: "weakref.WeakSet" = weakref.WeakSet()
_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # torch optimizer -> {id(param): its state dict}


def _local_numel(p: Any) -> int:
    local = getattr(p, "_local_tensor", None)
    return int(local.numel()) if local is not None else int(p.numel())


def torch_optimizers(optimizer: Any) -> List[Any]:
    """The torch optimizers inside a Megatron optimizer (chained or not; a torch optimizer is returned itself)."""
    import torch

    out = []
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", o)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return out


def complete_fsdp_optimizer_state(optimizer: Any) -> int:
    """Give every parameter with an empty local shard the optimizer state its peers have, with the rank's current
    ``step``, and order the state as the parameter groups are (module docstring); returns how many parameters got
    new state. A parameter with local elements but no state yet (before the first step) is left alone, and so is an
    optimizer none of whose parameters has state (nothing to copy the keys from)."""
    import torch

    added = 0
    for inner in torch_optimizers(optimizer):
        params = [p for g in inner.param_groups for p in g["params"]]
        state = inner.state
        ref = next((state[p] for p in params if p in state and state[p] and _local_numel(p) > 0), None)
        if ref is None:
            continue
        empty = [p for p in params if _local_numel(p) == 0]
        for p in empty:
            have = state.get(p)
            new = {}
            for k, v in ref.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:  # step (and other per-parameter scalars)
                    new[k] = v.detach().clone()
                elif isinstance(v, torch.Tensor):  # moments: shaped like the parameter, empty on this rank
                    new[k] = have[k] if have and k in have else torch.zeros_like(p, dtype=v.dtype)
                else:
                    new[k] = v
            if not have:
                added += 1
            state[p] = new
        # the parameter groups' order, on every rank (per-DTensor collectives pair by position)
        ordered = [(p, state.pop(p)) for p in params if p in state]
        rest = list(state.items())
        state.clear()
        for p, s in ordered + rest:
            state[p] = s
    return added


def restore_split_state(inner: Any) -> int:
    """Undo what a load of a SwiGLU model's fsdp_dtensor checkpoint leaves in the torch optimizer ``inner`` (NeMo
    2.7's ``MegatronStrategy._get_fsdp_dtensor_state_dict`` with megatron-core 0.15's ``handle_swiglu_in_state_dict``):
    the split works in place on the state dict's ``state``, so the ``linear_fc1`` entries are replaced by their
    ``_w``/``_v`` halves (DTensor views of the state's own tensors, which the load fills), and the optimizer's
    ``load_state_dict`` then keeps those halves under their names and no state for ``linear_fc1`` -- its next step
    would start its Adam moments and step count afresh. The state objects the load filled are the ones the last step
    left (``_LAST``, recorded after every step): each parameter left without state gets its own back, and the keys that
    are no parameter are dropped. Returns how many parameters got their state back."""
    import torch

    params = [p for g in inner.param_groups for p in g["params"]]
    known = {id(p) for p in params}
    state = inner.state
    stray = [k for k in state if not (isinstance(k, torch.Tensor) and id(k) in known)]
    if not stray:
        return 0
    last = _LAST.get(inner, {})
    back = 0
    for p in params:
        if not state.get(p) and id(p) in last:
            state[p] = last[id(p)]
            back += 1
    for k in stray:
        del state[k]
    return back


def _record(inner: Any) -> None:
    _LAST[inner] = {id(p): inner.state[p] for g in inner.param_groups for p in g["params"] if inner.state.get(p)}


def _before_step(inner: Any, args: Any, kwargs: Any) -> None:
    restore_split_state(inner)


def _after_step(inner: Any, args: Any, kwargs: Any) -> None:
    complete_fsdp_optimizer_state(inner)
    _record(inner)


def keep_fsdp_optimizer_state_complete(optimizer: Any) -> int:
    """Hook each torch optimizer inside ``optimizer`` (once each; torch's ``register_step_pre_hook`` /
    ``register_step_post_hook``): before a step ``restore_split_state``, after it ``complete_fsdp_optimizer_state``
    and a record of the state objects. Returns how many were newly hooked; completes the state now as well."""
    n = 0
    for inner in torch_optimizers(optimizer):
        if inner in _HOOKED:
            continue
        inner.register_step_pre_hook(_before_step)
        inner.register_step_post_hook(_after_step)
        _HOOKED.add(inner)
        n += 1
    complete_fsdp_optimizer_state(optimizer)
    return n
