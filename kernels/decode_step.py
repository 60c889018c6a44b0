"""The small kernels of a Llama decode step, fused: what is left of a layer once its matmuls are counted.

At batch 1 a decode step reads every weight once and does little arithmetic, so on a GPU its time is
the weight reads plus a few microseconds per kernel. HF's eager Llama layer runs about forty kernels
(each RMSNorm six or seven element-wise ones, rotary ten, the cache write five), most of them on a
few kilobytes; recorded as a CUDA graph, their launch and tail cost is about half the step on an 8B
model. Three kernels replace them (``decode.engine.lean``'s fused target step runs them between its
matmuls):

- ``rms_norm``: the residual add and the RMSNorm after it, one program per token row;
- ``rope_write``: rotary on every query and key head of a token and the key/value write into the cache
  buffers at the layer's write offset (read on the device, so a recorded step replays at any offset);
  the queries come out grouped by key/value head (``[B, Hkv, G * T, D]``), so attention reads the cache
  without repeating it per query head;
- ``silu_mul``: SiLU of the gate times the up projection, from the fused gate/up matmul's output.

Each rounds where HF's modules round (to the model's dtype after every element-wise op, float32 inside
RMSNorm), so in float32 and bfloat16 the outputs are HF's up to the order of the norm's sum. Each has
its PyTorch reference beside it, which the fused step runs on a CPU and the tests compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.kernels import load_triton

triton, tl = load_triton()


# -- references --------------------------------------------------------------------------------


def rms_norm_reference(x, weight, eps: float, residual=None):
    """(x + residual, RMSNorm of it) as HF's LlamaRMSNorm computes it; the sum is None without a residual."""
    total = x + residual if residual is not None else None
    s = total if total is not None else x
    s32 = s.to(torch.float32)
    normed = weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return total, normed


def rotate(x, cos, sin):
    """HF's apply_rotary_pos_emb on one tensor [..., D], rounded where it rounds."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def rope_write_reference(qkv, cos, sin, keys, values, offset, heads: int, kv_heads: int):
    """Queries [B, Hkv, G * T, D] (row g * T + t: query head kv * G + g at token t) and the rotated keys
    and the values written into ``keys``/``values`` [B, Hkv, S, D] at slots offset .. offset + T - 1.
    qkv [B, T, (H + 2 Hkv) * D], the fused projection's output; cos, sin [B, T, D]; offset: a 0-d tensor."""
    b, t, _ = qkv.shape
    d = cos.shape[-1]
    g = heads // kv_heads
    q = qkv[..., : heads * d].view(b, t, heads, d)
    k = qkv[..., heads * d : (heads + kv_heads) * d].view(b, t, kv_heads, d)
    v = qkv[..., (heads + kv_heads) * d :].view(b, t, kv_heads, d)
    c, s = cos[:, :, None], sin[:, :, None]
    q, k = rotate(q, c, s), rotate(k, c, s)
    slots = offset + torch.arange(t, device=qkv.device)
    keys.index_copy_(2, slots, k.transpose(1, 2))
    values.index_copy_(2, slots, v.transpose(1, 2))
    return q.view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)


def silu_mul_reference(gate_up):
    """SiLU(gate) * up for the fused gate/up output [..., 2 I]."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


# -- kernels -------------------------------------------------------------------------------------


def rms_norm(x, weight, eps: float, residual=None):
    """``rms_norm_reference`` in one launch over rows of the last dimension."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, h = x2.shape
    normed = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else normed
    r2 = residual.reshape(-1, h) if residual is not None else x2
    _rms_kernel[(n,)](
        x2, r2, total, weight, normed, h, eps,
        x2.stride(0), r2.stride(0), total.stride(0), normed.stride(0),
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 2048 else 8,
    )  # fmt: skip
    return (total.view(shape) if residual is not None else None), normed.view(shape)


@triton.jit
def _rms_kernel(X, R, S, W, Y, H, eps, sx, sr, ss, sy, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(X + row * sx + cols, mask=inside, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * sr + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + row * ss + cols, x, mask=inside)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    y = (xf * inv).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=inside, other=0.0)
    tl.store(Y + row * sy + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=inside)


def rope_write(qkv, cos, sin, keys, values, offset, heads: int, kv_heads: int):
    """``rope_write_reference`` in one launch: a program per token and head (query heads, then key/value heads)."""
    b, t, _ = qkv.shape
    d = cos.shape[-1]
    g = heads // kv_heads
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty(b, kv_heads, g * t, d, dtype=qkv.dtype, device=qkv.device)
    _rope_kernel[(b * t, heads + kv_heads)](
        qkv, cos, sin, q, keys, values, offset,
        t, heads, kv_heads, g,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        d, BLOCK=triton.next_power_of_2(d), num_warps=1,
    )  # fmt: skip
    return q


@triton.jit
def _rope_kernel(QKV, COS, SIN, Q, K, V, OFF, T, HEADS, KV_HEADS, G,
                 s_b, s_t, sc_b, sc_t, sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, D, BLOCK: tl.constexpr):
    bt = tl.program_id(0)
    head = tl.program_id(1)
    b = bt // T
    t = bt % T
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    half = D // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, -1.0, 1.0)
    row = QKV + b * s_b + t * s_t
    c = tl.load(COS + b * sc_b + t * sc_t + cols, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * sc_b + t * sc_t + cols, mask=inside, other=0.0).to(tl.float32)
    dtype = QKV.dtype.element_ty
    base = head * D  # query heads, then key heads, in the projection's order
    x = tl.load(row + base + cols, mask=inside, other=0.0)
    xr = tl.load(row + base + partner, mask=inside, other=0.0).to(tl.float32) * sign
    # rounded as HF's x * cos + rotate_half(x) * sin: each product, then the sum
    y = ((x.to(tl.float32) * c).to(dtype).to(tl.float32) + (xr * s).to(dtype).to(tl.float32)).to(dtype)
    if head < HEADS:
        kv = head // G
        tl.store(Q + b * sq_b + kv * sq_h + ((head % G) * T + t) * sq_r + cols, y, mask=inside)
    else:
        kv = head - HEADS
        slot = tl.load(OFF) + t
        tl.store(K + b * sk_b + kv * sk_h + slot * sk_s + cols, y, mask=inside)
        v = tl.load(row + (HEADS + KV_HEADS + kv) * D + cols, mask=inside, other=0.0)
        tl.store(V + b * sv_b + kv * sv_h + slot * sv_s + cols, v, mask=inside)


def silu_mul(gate_up):
    """``silu_mul_reference`` in one launch over rows of the fused gate/up output."""
    shape = gate_up.shape
    gu = gate_up.reshape(-1, shape[-1])
    n, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*shape[:-1], inter)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER, s_in, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < INTER
    gate = tl.load(GU + row * s_in + cols, mask=inside, other=0.0)
    up = tl.load(GU + row * s_in + INTER + cols, mask=inside, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu in float32, rounded, then the product rounded
    tl.store(OUT + row * s_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=inside)


def ops(backend: str):
    """(rms_norm, rope_write, silu_mul) of ``backend`` ("triton" or "torch")."""
    if backend == "triton":
        return rms_norm, rope_write, silu_mul
    return rms_norm_reference, rope_write_reference, silu_mul_reference
