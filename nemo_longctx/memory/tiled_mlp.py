"""Sequence-tiled MLP: only one tile's intermediate activations are ever alive.

``tiled_mlp(fn, x, tiles)`` splits ``x`` along the sequence dim into contiguous tiles (the last ones one token
shorter when ragged) and runs ``fn`` on each tile without autograd, writing the results into one output tensor.
Only ``x`` is saved. In backward each tile is recomputed with autograd and differentiated at once with
``torch.autograd.grad`` w.r.t. the tile input and the parameters; parameter gradients are summed over tiles (in
fp32 for fp16/bf16 parameters, like an untiled matmul's accumulation) and returned once, so gradient-accumulator
hooks (Megatron DDP, FSDP) fire once per step, as for an untiled MLP.

``fn`` must act on each token independently (an MLP does; attention does not). It returns either a tensor with
the tile's sequence length along ``seq_dim`` or Megatron's ``(output, output_bias)`` pair, where ``output_bias``
(None or a tensor that does not depend on the input, e.g. ``linear_fc2.bias`` under ``skip_bias_add``) is
returned as is and gets its gradient through the first tile's recompute.

RNG (dropout inside ``fn``): the CPU and current-CUDA-device generator states are captured before each tile in
forward and restored before its recompute; pass ``rng_state_hooks=(get_states, set_states)`` for extra
generators (e.g. Megatron's ``get_cuda_rng_tracker().get_states / set_states``). Autocast state is replayed too.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .tile_policy import DEFAULT_MLP_TILE_TOKENS, TilePolicy, check_tiling_policy, resolve_tiles, tile_bounds

_HALF = (torch.float16, torch.bfloat16)
RngHooks = Tuple[Callable[[], Any], Callable[[Any], None]]


def _split_result(result) -> Tuple[Tensor, Optional[Tensor], bool]:
    """(output, bias, returned_a_pair) from what ``fn`` returned."""
    if isinstance(result, Tensor):
        return result, None, False
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], Tensor):
        if result[1] is not None and not isinstance(result[1], Tensor):
            raise ValueError(f"tiled_mlp: fn's second output must be a tensor or None, got {type(result[1])}")
        return result[0], result[1], True
    raise ValueError(f"tiled_mlp: fn must return a tensor or an (output, bias) pair, got {type(result)}")


def _capture_rng(device: torch.device, hooks: Optional[RngHooks]):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, (hooks[0]() if hooks is not None else None)


def _restore_rng(state, device: torch.device, hooks: Optional[RngHooks]) -> None:
    cpu, cuda, extra = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    if hooks is not None:
        hooks[1](extra)


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, bounds, seq_dim, rng_hooks, autocast, info, x, *params):
        out = bias = None
        pair = False
        rng_states = []
        with torch.no_grad():
            for i, (start, length) in enumerate(bounds):
                rng_states.append(_capture_rng(x.device, rng_hooks))
                tile_out, tile_bias, pair = _split_result(fn(x.narrow(seq_dim, start, length)))
                if tile_out.dim() != x.dim() or tile_out.shape[seq_dim] != length:
                    raise ValueError(
                        f"tiled_mlp: fn must keep the sequence dim {seq_dim} (tile of {length} tokens gave output "
                        f"shape {tuple(tile_out.shape)} for input shape "
                        f"{tuple(x.narrow(seq_dim, start, length).shape)})"
                    )
                if out is None:
                    shape = list(tile_out.shape)
                    shape[seq_dim] = x.shape[seq_dim]
                    out = tile_out.new_empty(shape)
                    bias = tile_bias
                out.narrow(seq_dim, start, length).copy_(tile_out)
                del tile_out, tile_bias
        ctx.set_materialize_grads(False)
        ctx.fn, ctx.bounds, ctx.seq_dim, ctx.rng_hooks, ctx.autocast = fn, bounds, seq_dim, rng_hooks, autocast
        ctx.rng_states = rng_states
        ctx.num_params = len(params)
        ctx.save_for_backward(x, *params)
        info["pair"] = pair
        if bias is not None:
            bias = bias.detach().clone()  # a fresh output of this Function (fn may return a parameter itself)
        return out, bias

    @staticmethod
    def backward(ctx, grad_out, grad_bias):
        x, *params = ctx.saved_tensors
        seq_dim = ctx.seq_dim
        need_x = ctx.needs_input_grad[6]
        param_idx = [i for i in range(ctx.num_params) if ctx.needs_input_grad[7 + i]]
        grad_x = torch.empty_like(x) if need_x else None
        grads: List[Optional[Tensor]] = [None] * ctx.num_params
        cpu_now = _capture_rng(x.device, ctx.rng_hooks)
        try:
            for i, (start, length) in enumerate(ctx.bounds):
                _restore_rng(ctx.rng_states[i], x.device, ctx.rng_hooks)
                x_tile = x.narrow(seq_dim, start, length).detach().requires_grad_(need_x)
                device_type, enabled, dtype = ctx.autocast
                with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    tile_out, tile_bias, _ = _split_result(ctx.fn(x_tile))
                roots, root_grads = [], []
                if grad_out is not None:  # None when the output is unused (grads are not materialized)
                    roots.append(tile_out)
                    root_grads.append(grad_out.narrow(seq_dim, start, length))
                if i == 0 and grad_bias is not None and tile_bias is not None and tile_bias.requires_grad:
                    roots.append(tile_bias)
                    root_grads.append(grad_bias)
                inputs = ([x_tile] if need_x else []) + [params[j] for j in param_idx]
                differentiable = [r.requires_grad for r in roots]
                if inputs and roots and any(differentiable):
                    roots = [r for r, d in zip(roots, differentiable) if d]
                    root_grads = [g for g, d in zip(root_grads, differentiable) if d]
                    tile_grads = list(torch.autograd.grad(roots, inputs, root_grads, allow_unused=True))
                else:
                    tile_grads = [None] * len(inputs)
                del roots, root_grads, tile_out, tile_bias
                g = None
                if need_x:
                    g = tile_grads.pop(0)
                    if g is None:
                        grad_x.narrow(seq_dim, start, length).zero_()
                    else:
                        grad_x.narrow(seq_dim, start, length).copy_(g)
                for j, g in zip(param_idx, tile_grads):
                    if g is None:
                        continue
                    if grads[j] is None:  # a copy: never add into a tensor autograd handed out (may be shared)
                        grads[j] = g.to(torch.float32 if g.dtype in _HALF else g.dtype, copy=True)
                    else:
                        grads[j].add_(g)
                del tile_grads, g, x_tile
        finally:
            _restore_rng(cpu_now, x.device, ctx.rng_hooks)
        grads = [g if g is None or g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
        return (None, None, None, None, None, None, grad_x, *grads)


def tiled_mlp(
    fn: Callable[[Tensor], Any],
    x: Tensor,
    tiles: TilePolicy = "auto",
    *,
    seq_dim: int = 0,
    params: Optional[Sequence[Tensor]] = None,
    tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
    rng_state_hooks: Optional[RngHooks] = None,
):
    """Run the per-token function ``fn`` over sequence tiles of ``x``, keeping one tile's activations at a time.

    Args:
        fn: ``fn(x_tile) -> out_tile`` or ``-> (out_tile, bias)`` (Megatron MLP: ``[t, b, h] -> ([t, b, h], bias)``).
        x: input, sequence along ``seq_dim`` (Megatron: ``[s, b, h]``, ``seq_dim=0``).
        tiles: "off" (call ``fn(x)`` directly), "auto" (``ceil(s / tile_tokens)``) or a positive int <= s.
        params: tensors ``fn`` uses that need gradients (all must be listed, or their gradients are lost);
            defaults to ``fn.parameters()`` when ``fn`` is an ``nn.Module`` and is required otherwise.
        rng_state_hooks: optional ``(get_states, set_states)`` for generators besides torch's CPU/CUDA ones.
    Returns:
        what ``fn`` returns: the output (same shape as an untiled call) or ``(output, bias)``.
    """
    if not isinstance(x, Tensor):
        raise ValueError(f"tiled_mlp: x must be a tensor, got {type(x)}")
    if x.dim() == 0:
        raise ValueError("tiled_mlp: x must have a sequence dimension")
    seq_dim = seq_dim % x.dim()
    num_tiles = resolve_tiles(tiles, x.shape[seq_dim], tile_tokens, name="mlp tiles")
    if params is None:
        if not isinstance(fn, nn.Module):
            raise ValueError("tiled_mlp: pass params=[...] (the tensors fn uses) when fn is not an nn.Module")
        params = list(fn.parameters())
    params = list(params)
    if tiles == "off" or num_tiles == 1:
        return fn(x)
    autocast = (x.device.type, torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
    bounds = tile_bounds(x.shape[seq_dim], num_tiles)
    info: dict = {}
    out, bias = _TiledMLPFunction.apply(fn, bounds, seq_dim, rng_state_hooks, autocast, info, x, *params)
    return (out, bias) if info["pair"] else out


class TiledMLP(nn.Module):
    """``nn.Module`` wrapper: ``TiledMLP(mlp, tiles)(x) == tiled_mlp(mlp, x, tiles)`` (same outputs as ``mlp(x)``).

    The tile policy is validated here, at construction. For Megatron, subclassing its ``MLP`` and calling
    ``tiled_mlp(super().forward, hidden_states, tiles, params=list(self.parameters()))`` keeps the state dict
    unchanged; this wrapper adds a ``mlp.`` prefix to parameter names.
    """

    def __init__(
        self,
        mlp: nn.Module,
        tiles: TilePolicy = "auto",
        *,
        seq_dim: int = 0,
        tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
        rng_state_hooks: Optional[RngHooks] = None,
    ):
        super().__init__()
        check_tiling_policy(tiles, "mlp tiles")
        if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
            raise ValueError(f"mlp tile_tokens must be a positive int, got {tile_tokens!r}")
        self.mlp, self.tiles, self.seq_dim = mlp, tiles, seq_dim
        self.tile_tokens, self.rng_state_hooks = tile_tokens, rng_state_hooks

    def forward(self, x: Tensor):
        return tiled_mlp(
            self.mlp,
            x,
            self.tiles,
            seq_dim=self.seq_dim,
            tile_tokens=self.tile_tokens,
            rng_state_hooks=self.rng_state_hooks,
        )
