"""Attention of many stacked queries over one shared key/value prefix: Hydragen's prefix part.

query [Hkv, M, D] (``decode.engine.hydragen`` stacks every row's queries of a key/value head's group: M =
g * B * T), key/value [Hkv, P, D]; returns the softmax attention output [Hkv, M, D] and its
log-sum-exp [Hkv, M] in float32 (float64 for float64 inputs), which is what merging it with each
row's suffix attention needs.

The reference materialises the scores [Hkv, M, P] and converts the prefix to float32 first. The kernel
reads the prefix in its own dtype once per M block: one program per (M block, kv head, P split) streams
its P range in tiles with an online softmax, so no [M, P] scores reach memory. Decoding has a small M
(one M block per kv head), too few programs to fill a GPU, so P is split across programs and a second
launch merges the splits by their log-sum-exps (flash-decoding).
"""

from __future__ import annotations

import math

import torch

from specdec.kernels import backend as pick_backend
from specdec.kernels import load_triton
from specdec.kernels.tree_attention import softmax_tile

triton, tl = load_triton()

BLOCK_N = 64


def prefix_attention_reference(query, key, value, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two matrix products around a softmax: (out [Hkv, M, D], lse [Hkv, M]), at least float32."""
    work = torch.promote_types(query.dtype, torch.float32)
    scores = torch.bmm(query.to(work), key.to(work).transpose(1, 2)) * scale  # [Hkv, M, P]
    return torch.bmm(torch.softmax(scores, dim=-1), value.to(work)), torch.logsumexp(scores, dim=-1)


def prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    backend: str = "auto",
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Hkv, M, D], lse [Hkv, M]); ``num_splits`` (P ranges per M block) is chosen when None."""
    if pick_backend(backend, query.device) == "torch":
        return prefix_attention_reference(query, key, value, scale)
    return _prefix_attention_triton(query, key, value, scale, num_splits)


def _prefix_attention_triton(query, key, value, scale, num_splits):
    kv_heads, rows, dim = query.shape
    length = key.shape[1]
    work = torch.promote_types(query.dtype, torch.float32)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot needs K >= 16: small heads are zero-padded
    # tl.dot needs >= 16 rows; 128 x 128 accumulators are the most registers one program should hold
    block_m = max(16, min(128 if block_d <= 128 else 64, triton.next_power_of_2(rows)))
    m_blocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = _num_splits(kv_heads * m_blocks, length, query.device)
    split_len = max(1, triton.cdiv(triton.cdiv(length, num_splits), BLOCK_N)) * BLOCK_N
    num_splits = max(1, triton.cdiv(length, split_len))  # every split holds keys, but when P = 0

    out = torch.empty(num_splits, kv_heads, rows, dim, dtype=work, device=query.device)
    lse = torch.empty(num_splits, kv_heads, rows, dtype=work, device=query.device)
    meta = dict(D=dim, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=8 if block_m * block_d >= 128 * 128 else 4)
    _prefix_attention_kernel[(m_blocks, kv_heads, num_splits)](
        query, key, value, out, lse,
        rows, length, split_len, scale * math.log2(math.e),
        *query.stride()[:2], *key.stride()[:2], *value.stride()[:2], *out.stride()[:3], *lse.stride()[:2],
        BLOCK_N=BLOCK_N, PRECISION="ieee" if query.dtype in (torch.float32, torch.float64) else "tf32", **meta,
    )  # fmt: skip
    if num_splits == 1:
        return out[0], lse[0]
    merged, merged_lse = torch.empty_like(out[0]), torch.empty_like(lse[0])
    _merge_splits_kernel[(m_blocks, kv_heads)](
        out, lse, merged, merged_lse,
        rows, num_splits, *out.stride()[:3], *lse.stride()[:2], *merged.stride()[:2], merged_lse.stride(0),
        **meta,
    )  # fmt: skip
    return merged, merged_lse


def _num_splits(programs: int, length: int, device: torch.device) -> int:
    """Enough P splits for ~2 programs per SM, keeping at least 2 tiles per split."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, length // (2 * BLOCK_N)))


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    M, P, split_len, scale_log2,
    s_qh, s_qm, s_kh, s_kp, s_vh, s_vp, s_os, s_oh, s_om, s_ls, s_lh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    acc_ty = o_ptr.dtype.element_ty  # tl.dot accumulates in it too: float64 for float64, else float32
    hkv = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + hkv * s_qh + rows[:, None] * s_qm + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + hkv * s_kh
    v_base = v_ptr + hkv * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), acc_ty)
    l_i = tl.zeros([BLOCK_M], acc_ty)
    acc = tl.zeros([BLOCK_M, BLOCK_D], acc_ty)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, P)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * s_kp + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        v = tl.load(v_base + n[:, None] * s_vp + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = softmax_tile(scores, v, m_i, l_i, acc, PRECISION)
    # an empty prefix (P = 0) gives out 0 and lse -inf, as the reference does
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + split * s_os + hkv * s_oh + rows[:, None] * s_om + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + split * s_ls + hkv * s_lh + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    po_ptr, plse_ptr, o_ptr, lse_ptr,
    M, S,
    s_ps, s_ph, s_pm, s_xs, s_xh, s_oh, s_om, s_lh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Each split's output weighted by its share of the softmax mass, exp(lse_split - lse)."""
    acc_ty = o_ptr.dtype.element_ty
    hkv = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < D)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), acc_ty)
    l_i = tl.zeros([BLOCK_M], acc_ty)
    acc = tl.zeros([BLOCK_M, BLOCK_D], acc_ty)
    for split in range(S):  # no split is empty: every lse is finite
        x = tl.load(plse_ptr + split * s_xs + hkv * s_xh + rows, mask=row_ok, other=0.0)
        m_new = tl.maximum(m_i, x)
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(x - m_new)
        part = tl.load(po_ptr + split * s_ps + hkv * s_ph + rows[:, None] * s_pm + d[None, :], mask=mask, other=0.0)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_i = l_i * alpha + w
        m_i = m_new
    tl.store(o_ptr + hkv * s_oh + rows[:, None] * s_om + d[None, :], acc / l_i[:, None], mask=mask)
    tl.store(lse_ptr + hkv * s_lh + rows, m_i + tl.log(l_i), mask=row_ok)
