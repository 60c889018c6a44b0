"""Tree attention for verification: T tree tokens (T <= 64) attend over the cache and the tree.

query [B, H, T, D], key/value [B, Hkv, S, D] (H a multiple of Hkv: GQA), mask [B or 1, 1, T, S]
boolean, True = attend. One program per (query block, batch x kv head, S split): the G = H / Hkv
query heads sharing a kv head are stacked into the rows of one block, so each K/V tile is read
once for the whole group, which is what makes the kernel memory-bound rather than launch-bound.
Each program streams its S range in tiles with an online softmax and skips tiles its rows do not
attend (cache padding of shorter rows). When B * Hkv is too small to fill the GPU, S is split
across programs and the partial results are merged (flash-decoding).

A row with nothing to attend gives 0 (SDPA gives NaN); a tree token always attends to itself.
"""

from __future__ import annotations

import math

import torch

from specdec.kernels import backend as pick_backend
from specdec.kernels import load_triton

triton, tl = load_triton()

MAX_TREE = 64
ATTENTION_NAME = "specdec_tree"


def tree_attention_reference(query, key, value, mask, scale: float | None = None) -> torch.Tensor:
    """SDPA with the kv heads repeated for GQA: [B, H, T, D]."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Masked attention [B, H, T, D]; ``num_splits`` (S ranges per row) is chosen when None."""
    if pick_backend(backend, query.device) == "torch" or query.shape[2] > MAX_TREE:
        return tree_attention_reference(query, key, value, mask, scale)
    return _tree_attention_triton(query, key, value, mask, scale, num_splits)


def _tree_attention_triton(query, key, value, mask, scale, num_splits):
    bsz, heads, tree, dim = query.shape
    kv_heads, seq = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    mask = mask.expand(bsz, 1, tree, seq).view(torch.uint8)  # zero-copy: stride 0 where broadcast

    block_m = max(16, min(64, triton.next_power_of_2(group * tree)))  # tl.dot needs >= 16 rows
    block_n = 64
    m_blocks = triton.cdiv(group * tree, block_m)
    if num_splits is None:
        num_splits = _num_splits(bsz * kv_heads * m_blocks, seq, block_n, query.device)
    split_len = triton.cdiv(triton.cdiv(seq, num_splits), block_n) * block_n
    num_splits = triton.cdiv(seq, split_len)

    partial = torch.empty(num_splits, bsz, heads, tree, dim, dtype=torch.float32, device=query.device)
    row_max = torch.empty(num_splits, bsz, heads, tree, dtype=torch.float32, device=query.device)
    row_sum = torch.empty_like(row_max)
    _tree_attention_kernel[(m_blocks, bsz * kv_heads, num_splits)](
        query, key, value, mask, partial, row_max, row_sum,
        tree, seq, kv_heads, group, split_len, scale * math.log2(math.e),
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], mask.stride(0), mask.stride(2), mask.stride(3),
        *partial.stride()[:4], *row_max.stride()[:3],
        # tl.dot needs K >= 16: heads smaller than 16 are zero-padded (masked loads)
        D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    return _merge_splits(partial, row_max, row_sum).to(query.dtype)


def _num_splits(programs: int, seq: int, block_n: int, device: torch.device) -> int:
    """Enough S splits for ~2 programs per SM, keeping at least 4 tiles per split."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, seq // (4 * block_n)))


def _merge_splits(partial, row_max, row_sum) -> torch.Tensor:
    """Combine per-split normalised outputs by their softmax mass (maxima are in log2 units)."""
    if partial.shape[0] == 1:
        return partial[0]
    top = row_max.amax(0)
    top = torch.where(torch.isinf(top), 0.0, top)
    weight = row_sum * torch.exp2(row_max - top)  # 0 for a split whose rows attended nothing
    total = weight.sum(0)
    return (weight[..., None] * partial).sum(0) / torch.where(total > 0, total, 1.0)[..., None]


@triton.jit
def softmax_tile(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of keys folded into a running softmax (flash attention's online softmax): ``scores``
    [M, N] in log2 units, -inf where a query does not attend; ``v`` [N, D]. Returns the running max,
    normaliser and unnormalised output (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing attended yet
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, max_ptr, sum_ptr,
    T, S, HKV, G, split_len, scale_log2,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mb, s_mt, s_ms,
    s_os, s_ob, s_oh, s_ot, s_xs, s_xb, s_xh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    hkv = pid_bh % HKV
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (head in group, tree token) pairs
    row_ok = rows < G * T
    head = hkv * G + rows // T
    tok = rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + b * s_qb + head[:, None] * s_qh + tok[:, None] * s_qt + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + b * s_kb + hkv * s_kh
    v_base = v_ptr + b * s_vb + hkv * s_vh
    m_base = mask_ptr + b * s_mb + tok[:, None] * s_mt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, S)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        allow = tl.load(m_base + n[None, :] * s_ms, mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
        if tl.max(allow.to(tl.int32)) > 0:  # skip K/V tiles no row attends
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * s_ks + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            scores = tl.where(allow, scores, float("-inf"))
            v = tl.load(v_base + n[:, None] * s_vs + d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = softmax_tile(scores, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = o_ptr + split * s_os + b * s_ob + head[:, None] * s_oh + tok[:, None] * s_ot
    tl.store(o_rows + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    x_rows = split * s_xs + b * s_xb + head * s_xh + tok
    tl.store(max_ptr + x_rows, m_i, mask=row_ok)
    tl.store(sum_ptr + x_rows, l_i, mask=row_ok)


def specdec_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, T, D], key/value [B, Hkv, S, D] (already
    updated in the cache); returns ([B, T, H, D], None) like ``sdpa_attention_forward``.

    The kernel takes the verification forward (a prepared 4-D boolean mask, T <= 64, CUDA, no
    dropout, no paged cache, not under torch.compile); anything else (prefill, CPU, a compiled step)
    goes to transformers' SDPA path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seq = key.shape[2]
    kernel_case = (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[-1] == seq
        and query.shape[2] <= MAX_TREE
        and dropout == 0.0
        and kwargs.get("cache") is None
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and pick_backend("auto", query.device) == "triton"
        # a compiled step (CUDA graphs through inductor) cannot trace into the kernel launch; inductor
        # compiles SDPA's path well, fused with the rest of the step
        and not torch.compiler.is_compiling()
    )
    if not kernel_case:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = _tree_attention_triton(query, key, value, attention_mask, scaling, None)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = ATTENTION_NAME) -> str:
    """Register the attention function, and SDPA's mask builder under the same name.

    4-D masks pass through transformers' mask creation untouched whatever the name, but a 2-D mask
    (prefill) is only turned into a 4-D one for names the mask interface knows; without this the
    prefill would silently run unmasked. Use ``model.set_attn_implementation(name)`` afterwards.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, specdec_tree_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
