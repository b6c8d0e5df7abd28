"""Fast forward passes of the frozen transformer towers (timm ViT blocks, open_clip image tower).

The backbones never train, which the generic module code does not exploit. Here:

* linear layers of frozen weights run through ``frozen_linear``: its backward computes only the
  input gradient (``g @ W``) and saves no activation for a weight gradient;
* residual adds, the per-image semantic shift and output biases are folded into the GEMM's
  accumulator (``addmm`` into the residual stream) instead of extra passes over the tokens;
* the **last block only needs its class token**: its query is the CLS row, so attention scores
  are ``q_cls · (W_k h_t)`` = ``(W_kᵀ q_cls) · h_t`` and the attention output is
  ``W_v (Σ_t a_t h_t) + b_v`` (attention rows sum to one; ``b_k`` shifts every score of a row
  equally and drops out of the softmax). The keys, values, projection and MLP of the other 64
  tokens are never formed — about a sixth of the ViT's GEMM work and a quarter of CLIP's at the
  bench dims (docs/benchmarks.md);
* without autograd (inference, CLIP queries) element-wise ops run in place.

Every rewrite is exact algebra; results differ from the module path only by float32 rounding
(checked against the reference's golden vectors in tests/test_conformance.py). Blocks of a kind
this file does not know (gates, extra norms, layer scale, other activations) make
``supports_*`` return False and callers keep the module path; so does the environment variable
``STARFED_FAST_TOWERS=0`` (to compare both paths, docs/benchmarks.md), which ``enabled`` reads
when a backbone pair is built (``Backbones.fast_towers``).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from open_clip.transformer import QuickGELU, ResidualAttentionBlock
from open_clip.transformer import VisionTransformer as ClipVisionTransformer
from timm.layers import Attention, Mlp
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from starfed.shared.config import environment
from starfed.shared.knob import as_bool


def enabled() -> bool:
    """The environment knob ``fast-towers`` (``STARFED_FAST_TOWERS``), read at each call: False
    has every tower built from now on run its own modules' forward."""
    return as_bool(environment(), "fast-towers")


class _FrozenLinearFn(torch.autograd.Function):
    """``y = base + x @ W.T (+ b)`` for a frozen ``W``: the backward forms only ``g @ W``.
    Written for ``torch.func`` too (``setup_context``, a generated vmap rule): a private site's
    DP-SGD takes per-image gradients through the towers with ``vmap`` of ``grad``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        base: torch.Tensor | None,
    ) -> torch.Tensor:
        return _linear(x, weight, bias, base, in_place=False)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, weight, _, base = inputs
        ctx.save_for_backward(weight)
        ctx.has_base = base is not None

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, torch.Tensor | None]:
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_base = grad if ctx.has_base and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_base


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    base: torch.Tensor | None,
    in_place: bool,
) -> torch.Tensor:
    """2-D ``base + x @ W.T + b`` with the adds folded into the GEMM's accumulator."""
    if torch.is_autocast_enabled(x.device.type):  # low-precision GEMM, float32 residual stream
        y = F.linear(x, weight, bias)
        if base is None:
            return y
        return base.add_(y) if in_place else base + y
    if base is None:
        return torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
    if in_place:
        out = base.add_(bias) if bias is not None else base
    else:
        out = base + bias if bias is not None else base.clone()
    return out.addmm_(x, weight.t())


def frozen_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    base: torch.Tensor | None = None,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """``base + x @ W.T + b`` over the last dim for a frozen ``W`` (``base`` may need grad).

    ``in_place`` lets a caller that owns ``base`` have the result accumulated into it when no
    graph is recorded (a no-grad forward).
    """
    shape = x.shape
    out_features = weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    b2 = None if base is None else base.reshape(-1, out_features)
    needs_graph = torch.is_grad_enabled() and (
        x.requires_grad or (base is not None and base.requires_grad)
    )
    if needs_graph:
        out: torch.Tensor = _FrozenLinearFn.apply(x2, weight, bias, b2)
    else:
        out = _linear(x2, weight, bias, b2, in_place=in_place and not torch.is_grad_enabled())
    return out.view(*shape[:-1], out_features)


def _is_exact_gelu(act: nn.Module) -> bool:
    return isinstance(act, nn.GELU) and act.approximate == "none"


def _gelu(x: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """The block's activation; in place when no graph is recorded."""
    if isinstance(act, QuickGELU):
        if torch.is_grad_enabled() and x.requires_grad:
            return x * torch.sigmoid(1.702 * x)
        return x.mul_(torch.sigmoid(1.702 * x))
    if torch.is_grad_enabled() and x.requires_grad:
        return F.gelu(x)
    result: torch.Tensor = torch.ops.aten.gelu_(x)
    return result


# --- timm ViT -------------------------------------------------------------------------------


def supports_timm_vit(vit: VisionTransformer) -> bool:
    """True when every block is the plain pre-norm ViT block the fast path implements."""
    for block in vit.blocks:
        attn = cast(Attention, block.attn)
        if not isinstance(block, Block) or not isinstance(block.mlp, Mlp):
            return False
        plain = (
            block.ls1,
            block.ls2,
            block.drop_path1,
            block.drop_path2,
            attn.q_norm,
            attn.k_norm,
            getattr(attn, "norm", nn.Identity()),
            block.mlp.norm,
        )
        if not all(isinstance(m, nn.Identity) for m in plain):
            return False
        if getattr(attn, "gate", None) is not None or not _is_exact_gelu(block.mlp.act):
            return False
        if not isinstance(block.norm1, nn.LayerNorm) or not isinstance(block.norm2, nn.LayerNorm):
            return False
    return vit.cls_token is not None and vit.global_pool == "token"


def _attention_all(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Multi-head self-attention of every token from packed ``qkv`` [B, T, 3C] → [B, T, C]."""
    b, t, three_c = qkv.shape
    c = three_c // 3
    q, k, v = qkv.view(b, t, 3, n_heads, c // n_heads).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v)  # [B, H, T, D]
    return out.transpose(1, 2).reshape(b, t, c)


def _attention_cls(
    h: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    n_heads: int,
) -> torch.Tensor:
    """Attention output of the class token only [B, C], from normed tokens ``h`` [B, T, C].

    Scores ``q·k_t = (W_kᵀ q)·h_t + q·b_k`` (the last term is the same for every t and leaves
    the softmax unchanged); output ``Σ_t a_t v_t = W_v (Σ_t a_t h_t) + b_v``.
    """
    b, _, c = h.shape
    d = c // n_heads
    _, w_k, w_v = qkv_weight.view(3, n_heads, d, c).unbind(0)  # each [H, D, C]
    q = h[:, 0] @ qkv_weight[:c].t()
    if qkv_bias is not None:
        q = q + qkv_bias[:c]
    q = q.view(b, n_heads, d) * (1.0 / math.sqrt(d))
    u = torch.einsum("bhd,hdc->bhc", q, w_k)  # W_kᵀ q per head
    scores = torch.bmm(u, h.transpose(1, 2))  # [B, H, T]
    weights = torch.softmax(scores, dim=-1)
    pooled = torch.bmm(weights, h)  # [B, H, C]: Σ_t a_t h_t per head
    out = torch.einsum("bhc,hdc->bhd", pooled, w_v).reshape(b, c)
    if qkv_bias is not None:
        out = out + qkv_bias[2 * c :]
    return out


def _offset(bias: torch.Tensor | None, shift: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """What a block adds to its attention output besides ``W_o·attn``: bias + shift, [B|1, C]."""
    if shift is None:
        return bias[None, :] if bias is not None else x.new_zeros(1, x.shape[-1])
    return shift if bias is None else shift + bias


def _timm_parts(block: Block) -> tuple[Attention, Mlp]:
    """The block's attention and MLP, of the plain kinds :func:`supports_timm_vit` admitted
    (timm types them as any module)."""
    return cast(Attention, block.attn), cast(Mlp, block.mlp)


def _timm_block(block: Block, x: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """One ViT block on all tokens; ``shift`` [B, C] is added to the attention output."""
    attn, mlp = _timm_parts(block)
    qkv = frozen_linear(block.norm1(x), attn.qkv.weight, attn.qkv.bias)
    attended = _attention_all(qkv, attn.num_heads)
    base = x + _offset(attn.proj.bias, shift, x)[:, None, :]  # one pass over the tokens
    x = frozen_linear(attended, attn.proj.weight, None, base, in_place=True)
    hidden = _gelu(frozen_linear(block.norm2(x), mlp.fc1.weight, mlp.fc1.bias), mlp.act)
    return frozen_linear(hidden, mlp.fc2.weight, mlp.fc2.bias, x, in_place=True)


def _timm_last_block(block: Block, x: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """The last ViT block, for the class token only → [B, C]."""
    attn, mlp = _timm_parts(block)
    attended = _attention_cls(block.norm1(x), attn.qkv.weight, attn.qkv.bias, attn.num_heads)
    base = x[:, 0] + _offset(attn.proj.bias, shift, x)
    cls = frozen_linear(attended, attn.proj.weight, None, base, in_place=True)
    hidden = _gelu(frozen_linear(block.norm2(cls), mlp.fc1.weight, mlp.fc1.bias), mlp.act)
    return frozen_linear(hidden, mlp.fc2.weight, mlp.fc2.bias, cls, in_place=True)


def timm_vit_cls(
    vit: VisionTransformer, images: torch.Tensor, shifts: torch.Tensor | None
) -> torch.Tensor:
    """Final-LayerNorm CLS features [B, C]; ``shifts`` [B, L, C] are added per block."""
    x = vit.patch_embed(images)
    x = vit._pos_embed(x)
    x = vit.patch_drop(x)
    x = vit.norm_pre(x)
    blocks = cast(list[Block], list(vit.blocks))  # supports_timm_vit admitted only these
    for layer, block in enumerate(blocks[:-1]):
        x = _timm_block(block, x, None if shifts is None else shifts[:, layer])
    cls = _timm_last_block(blocks[-1], x, None if shifts is None else shifts[:, -1])
    features: torch.Tensor = vit.norm(cls)
    return features


# --- open_clip image tower --------------------------------------------------------------------


def supports_clip_visual(visual: nn.Module) -> bool:
    """True for open_clip's plain ViT image tower with class-token pooling."""
    if not isinstance(visual, ClipVisionTransformer):
        return False
    if not hasattr(visual, "_embeds"):  # open_clip < 2.24 has no separate embedding step
        return False
    if visual.attn_pool is not None or visual.pool_type != "tok" or visual.final_ln_after_pool:
        return False
    if not getattr(visual.transformer, "batch_first", True):
        return False
    for block in visual.transformer.resblocks:
        if hasattr(block, "ln_1_kv") or not isinstance(block.attn, nn.MultiheadAttention):
            return False
        if not isinstance(block.ls_1, nn.Identity) or not isinstance(block.ls_2, nn.Identity):
            return False
        act = block.mlp.gelu
        if not (isinstance(act, QuickGELU) or _is_exact_gelu(act)):
            return False
        if block.attn.in_proj_weight is None or not block.attn._qkv_same_embed_dim:
            return False
        for norm in (block.ln_1, block.ln_2):
            if not isinstance(norm, nn.LayerNorm):
                return False
    return isinstance(visual.ln_post, nn.LayerNorm)


def _clip_block(block: ResidualAttentionBlock, x: torch.Tensor, last: bool) -> torch.Tensor:
    """One open_clip residual block; ``last`` computes the class token only → [B, C]."""
    attn: nn.MultiheadAttention = block.attn
    mlp = block.mlp
    h = block.ln_1(x)
    if last:
        attended = _attention_cls(h, attn.in_proj_weight, attn.in_proj_bias, attn.num_heads)
        x = x[:, 0]
    else:
        qkv = frozen_linear(h, attn.in_proj_weight, attn.in_proj_bias)
        attended = _attention_all(qkv, attn.num_heads)
    x = frozen_linear(attended, attn.out_proj.weight, attn.out_proj.bias, x)
    hidden = _gelu(frozen_linear(block.ln_2(x), mlp.c_fc.weight, mlp.c_fc.bias), mlp.gelu)
    return frozen_linear(hidden, mlp.c_proj.weight, mlp.c_proj.bias, x, in_place=True)


def clip_image_embedding(visual: ClipVisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """open_clip ``visual(images)`` (class-token pooled, projected), computed class-token-last."""
    x = visual._embeds(images)
    blocks = list(visual.transformer.resblocks)
    for i, block in enumerate(blocks):
        x = _clip_block(block, x, last=i == len(blocks) - 1)
    cls: torch.Tensor = visual.ln_post(x)
    return cls @ visual.proj if visual.proj is not None else cls
