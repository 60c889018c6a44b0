"""Fused chain verification: ``decode.engine.verify.verify_chain_core`` in two Triton launches (dispatched
by ``decode.engine.verify.verify_chain_accelerated``, which falls back to the reference where the kernel does
not apply).

Stage 1 (one program per row b and position j <= K) streams the logits row over V tiles once and
keeps what verification needs: the argmax (greedy) or the online-softmax max and sum of
logits / T, p(x_j) and q(x_j) (sampling). Stage 2 (one program per row) turns those numbers into
the accepted length, then samples the next token from the single distribution that matters
(p, p without x, or normalize(max(p - q, 0))) by re-reading that one row twice: once for the total
mass, once for the inverse-CDF scan, which stops at the sampled tile. Neither stage materialises a
softmax row and nothing synchronises with the host.

Exactness: integer results equal the reference's for the same uniforms except where a uniform lies
within float32 rounding (~1e-7 relative) of a decision boundary, because the kernel sums in a
different order than torch. top-p < 1 needs a sort of every row; the kernel does not do it and the
dispatch falls back to the reference.
"""

from __future__ import annotations

import torch

from specdec.kernels import load_triton

triton, tl = load_triton()


def verify_chain_triton(logits, tokens, draft_probs, greedy: bool, temperature: float, u_accept, u_sample):
    """(accepted [B], next_token [B]) int64, as the reference for the same uniforms; top-p = 1, K >= 1."""
    bsz, k = tokens.shape
    vocab = logits.shape[-1]
    dev = logits.device
    has_q = draft_probs is not None and not greedy
    logits = _unit_last_stride(logits)
    tokens = _unit_last_stride(tokens)
    q = _unit_last_stride(draft_probs) if has_q else logits  # any pointer: unused when HAS_Q is off
    if greedy:  # the uniforms are not read; give the kernel valid pointers
        u_accept = torch.zeros(bsz, k, device=dev)
        u_sample = torch.zeros(bsz, device=dev)

    stats = torch.empty(4, bsz, k + 1, dtype=torch.float32, device=dev)  # max, sum, p(x), q(x)
    best = torch.empty(bsz, k + 1, dtype=torch.int64, device=dev)
    accepted = torch.empty(bsz, dtype=torch.int64, device=dev)
    next_token = torch.empty(bsz, dtype=torch.int64, device=dev)
    temperature = max(temperature, 1e-5)  # the reference's clamp
    block_v = min(4096, triton.next_power_of_2(vocab))

    _row_stats_kernel[(bsz, k + 1)](
        logits, tokens, q, stats, best,
        vocab, k, temperature,
        logits.stride(0), logits.stride(1), tokens.stride(0), q.stride(0), q.stride(1), stats.stride(0),
        GREEDY=greedy, HAS_Q=has_q, BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    _accept_kernel[(bsz,)](
        logits, tokens, q, stats, best, u_accept, u_sample, accepted, next_token,
        vocab, k, temperature,
        logits.stride(0), logits.stride(1), tokens.stride(0), q.stride(0), q.stride(1), stats.stride(0),
        u_accept.stride(0), u_accept.stride(1), u_sample.stride(0),
        GREEDY=greedy, HAS_Q=has_q, BLOCK_K=triton.next_power_of_2(max(k, 1)), BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    return accepted, next_token


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # kernels index the vocab dimension with stride 1 so tile loads coalesce
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _online_softmax_step(m, s, x):
    """Fold tile x into a running (max, sum of exp(x - max)); safe when everything so far is -inf."""
    m_new = tl.maximum(m, tl.max(x, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
    return m_new, s


@triton.jit
def _row_stats_kernel(
    logits_ptr, tokens_ptr, q_ptr, stats_ptr, best_ptr,
    V, K, temperature,
    s_lb, s_lk, s_tb, s_qb, s_qk, s_stat,
    GREEDY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)  # int64 offsets: B * (K+1) * V can pass 2**31
    j = tl.program_id(1)
    row = logits_ptr + b * s_lb + j * s_lk
    out = b * (K + 1) + j
    offs = tl.arange(0, BLOCK_V)
    if GREEDY:
        best_val = float("-inf")
        best_idx = 0
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, 0)
            tile_arg = tl.argmax(x, 0, tie_break_left=True)
            # strict > keeps the earliest maximum, as torch.argmax does (ties are common in bf16)
            take = tile_max > best_val
            best_idx = tl.where(take, start + tile_arg, best_idx)
            best_val = tl.where(take, tile_max, best_val)
        tl.store(best_ptr + out, best_idx.to(tl.int64))
    else:
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK_V):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m, s = _online_softmax_step(m, s, x / temperature)
        tl.store(stats_ptr + out, m)
        tl.store(stats_ptr + s_stat + out, s)
        if j < K:
            tok = tl.load(tokens_ptr + b * s_tb + j)
            px = tl.exp(tl.load(row + tok).to(tl.float32) / temperature - m) / s
            tl.store(stats_ptr + 2 * s_stat + out, px)
            if HAS_Q:
                qx = tl.load(q_ptr + b * s_qb + j * s_qk + tok).to(tl.float32)
                tl.store(stats_ptr + 3 * s_stat + out, qx)


@triton.jit
def _tile_masses(lrow, qrow, idx, V, m, s, temperature, x_tok, HAS_Q: tl.constexpr):
    """p on one tile, and the residual after a rejection: max(p - q, 0), or p with x removed."""
    valid = idx < V
    p = tl.exp(tl.load(lrow + idx, mask=valid, other=float("-inf")).to(tl.float32) / temperature - m) / s
    if HAS_Q:
        q = tl.load(qrow + idx, mask=valid, other=0.0).to(tl.float32)
        res = tl.maximum(p - q, 0.0)
    else:
        res = tl.where(idx == x_tok, 0.0, p)
    return p, res


@triton.jit
def _accept_kernel(
    logits_ptr, tokens_ptr, q_ptr, stats_ptr, best_ptr, ua_ptr, us_ptr, acc_ptr, next_ptr,
    V, K, temperature,
    s_lb, s_lk, s_tb, s_qb, s_qk, s_stat, s_uab, s_uak, s_usb,
    GREEDY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_k = ks < K
    toks = tl.load(tokens_ptr + b * s_tb + ks, mask=in_k, other=0)
    base = b * (K + 1)
    if GREEDY:
        ok = toks == tl.load(best_ptr + base + ks, mask=in_k, other=-1)
    else:
        px = tl.load(stats_ptr + 2 * s_stat + base + ks, mask=in_k, other=0.0)
        u = tl.load(ua_ptr + b * s_uab + ks * s_uak, mask=in_k, other=1.0)
        if HAS_Q:
            qx = tl.load(stats_ptr + 3 * s_stat + base + ks, mask=in_k, other=1.0)
            ok = u * qx < px  # u < p/q without dividing by a zero q
        else:
            ok = u < px
    accepted = tl.min(tl.where(in_k & (ok == 0), ks, K), 0)  # first failure, K if none
    tl.store(acc_ptr + b, accepted.to(tl.int64))
    if GREEDY:
        tl.store(next_ptr + b, tl.load(best_ptr + base + accepted))
    else:
        rejected = accepted < K
        m = tl.load(stats_ptr + base + accepted)
        s = tl.load(stats_ptr + s_stat + base + accepted)
        slot = tl.minimum(accepted, K - 1)
        x_tok = tl.load(tokens_ptr + b * s_tb + slot)
        lrow = logits_ptr + b * s_lb + accepted * s_lk
        qrow = q_ptr + b * s_qb + slot * s_qk
        offs = tl.arange(0, BLOCK_V)
        # Pass 1: total mass of p and of the residual. The running total is the last element of the
        # same tiled cumsum pass 2 computes, so pass 2 reproduces it bit for bit and u * total
        # always lands inside the scanned range.
        tot_p = 0.0
        tot_res = 0.0
        for start in range(0, V, BLOCK_V):
            p, res = _tile_masses(lrow, qrow, start + offs, V, m, s, temperature, x_tok, HAS_Q)
            tot_p = tl.max(tot_p + tl.cumsum(p, 0), 0)
            tot_res = tl.max(tot_res + tl.cumsum(res, 0), 0)
        # a residual with no mass can only follow an acceptance of probability one: fall back to p
        use_res = rejected & (tot_res > 0)
        target = tl.load(us_ptr + b * s_usb) * tl.where(use_res, tot_res, tot_p)
        # Pass 2: smallest index whose cumulative mass exceeds u * total (searchsorted, right=True)
        carry = 0.0
        found = V
        start = 0
        while (found == V) & (start < V):
            p, res = _tile_masses(lrow, qrow, start + offs, V, m, s, temperature, x_tok, HAS_Q)
            cdf = carry + tl.cumsum(tl.where(use_res, res, p), 0)
            found = tl.min(tl.where(cdf > target, start + offs, V), 0)
            carry = tl.max(cdf, 0)
            start += BLOCK_V
        tl.store(next_ptr + b, tl.minimum(found, V - 1).to(tl.int64))
