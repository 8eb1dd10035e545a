"""transformers' Llama run without its module machinery: the same weights and ops, called directly.

For a small model, LlamaForCausalLM.forward's per-call work (mask building, output records,
a module call per projection, rotate_half's cat and neg in every layer) costs about as much
as its matmuls. `packed_logits` is the training and forward pass of a cycle's packed row
(engine/compute.py), `sampling._llama_step` the decode step; both use these pieces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .packing import MultiLoRALinear, PackPlan, packed_attention


def is_llama(model: Any) -> bool:
    """Whether the direct passes run this model: transformers' own Llama (whose layers they
    call directly); other architectures go through their own forward."""
    return type(model).__name__ == "LlamaForCausalLM" and type(model).__module__.startswith("transformers.")


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's forward without the module call: in float32 torch's own `rms_norm` (its
    ops, one call), otherwise LlamaRMSNorm's ops in its order (it rounds to the input's dtype
    before the weight)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def rotary(inner: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, head dim] of `positions` [tokens], from the model's own rotary
    embedding (its scaling included), for `rotate`: rotate_half's sign moved onto sin."""
    n = positions.shape[0]
    cos, sin = inner.rotary_emb(hidden, positions.view(1, n))
    half = cos.shape[-1] // 2
    return cos.view(n, 1, -1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).view(n, 1, -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' x cos + rotate_half(x) sin, exactly, as x cos + roll(x) sin' (sin' from
    `rotary`): x [tokens, heads, head dim], q and k of a layer side by side in one pass."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def packed_logits(base: Any, ids: torch.Tensor, positions: torch.Tensor, plan: PackPlan) -> torch.Tensor:
    """Logits [tokens, vocab] of the packed row `ids` [tokens] (each sequence's `positions`),
    every segment through its tenant's LoRA, attention within each sequence (`plan.seq_lens`):
    what `base.model(input_ids=ids[None], position_ids=positions[None])` gives under `plan`.
    Call it with `plan` active (packing.active_plan): a row of several tenants goes through
    `MultiLoRALinear` as in the model's own forward."""
    model = base.model
    inner = model.model
    n = ids.shape[0]
    hidden = F.embedding(ids, inner.embed_tokens.weight)
    cos, sin = rotary(inner, hidden, positions)
    one = plan.segments[0].adapter if len(plan.segments) == 1 else None
    for layer in inner.layers:
        attn = layer.self_attn
        q, k, v = _project(plan, one, (attn.q_proj, attn.k_proj, attn.v_proj), rms_norm(layer.input_layernorm, hidden))
        dim = attn.head_dim
        heads = q.shape[-1] // dim
        both = rotate(torch.cat((q, k), dim=-1).view(n, -1, dim), cos, sin).transpose(0, 1)
        values = v.view(n, -1, dim).transpose(0, 1)[None]
        out, _ = packed_attention(attn, both[None, :heads], both[None, heads:], values, None, scaling=attn.scaling)
        hidden = hidden + _project(plan, one, (attn.o_proj,), out.reshape(n, -1))[0]
        mlp = layer.mlp
        gate, up = _project(plan, one, (mlp.gate_proj, mlp.up_proj), rms_norm(layer.post_attention_layernorm, hidden))
        hidden = hidden + _project(plan, one, (mlp.down_proj,), mlp.act_fn(gate) * up)[0]
    return _project(plan, one, (model.lm_head,), rms_norm(inner.norm, hidden))[0]


def _project(plan: PackPlan, adapter: Any, layers: tuple[Any, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of `layers` (all fed `x` [tokens, in]), each with the row's LoRA deltas.

    A row of one tenant (`adapter`) is plain matmuls: the A side of layers fed the same input
    (q/k/v, gate/up) is one product, its weights side by side, and each B is added into its base
    output inside the matmul (addmm), alpha/rank as the product's scale. Several tenants: each
    layer's module (MultiLoRALinear groups the segments)."""
    if adapter is None or not all(isinstance(layer, MultiLoRALinear) for layer in layers):
        return [layer(x) for layer in layers]
    names = [layer.name for layer in layers]
    outs = [F.linear(x, layer.base.weight, layer.base.bias) for layer in layers]
    trained = [i for i, name in enumerate(names) if name in adapter.weights]
    if not trained:
        return outs
    pairs = [adapter.weights[names[i]] for i in trained]
    grads = [adapter.pass_grad[names[i]] for i in trained] if adapter.pass_grad is not None else None
    a_side = pairs[0][0] if len(pairs) == 1 else torch.cat([a for a, _ in pairs])
    bs = [b for _, b in pairs]
    if grads is not None and torch.is_grad_enabled():
        # This pass's weights are autograd leaves; their gradients reach the adapter in
        # `plan.flush_grads` (the A side's split by layer), so no per-layer node is in the graph.
        # (Tenants' equal batches stacked the same way, one batched matmul per layer group, were no
        # faster than MultiLoRALinear's grouping: 8 x 128 tokens, built-in model, 1 and 2 threads.)
        a_side = a_side.detach().requires_grad_()
        bs = [b.detach().requires_grad_() for b in bs]
        plan.grad_leaves.append((a_side, [ga for ga, _ in grads]))
        plan.grad_leaves += [(b, [gb]) for b, (_, gb) in zip(bs, grads)]
    hidden = F.linear(x.to(a_side.dtype), a_side)
    parts = hidden.split([b.shape[1] for b in bs], dim=-1) if len(bs) > 1 else (hidden,)
    for i, b, part in zip(trained, bs, parts):
        # added in the LoRA dtype and rounded once, as MultiLoRALinear does
        outs[i] = torch.addmm(outs[i].to(b.dtype), part, b.t(), alpha=adapter.scale).to(outs[i].dtype)
    return outs
