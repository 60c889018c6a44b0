"""train-acceptance: the SpecDec++ acceptance heads on a draft's last hidden state.

A head predicts P(draft token accepted | earlier drafts accepted) from what the draft knows when
it proposes the token: its last hidden state at the position that produced q, and three statistics
of q there (q(x) of the proposed token, max q, entropy). The stop decision therefore needs no draft
forward of the token itself: a round that stops costs exactly the forwards of a fixed-length round.

One artifact holds two heads, one per decode mode:
- sampling (T > 0; SpecDec++, Huang et al. 2024): label min(1, p(x)/q(x)) on the draft's own sampled
  token x (15% of positions use a token of the target instead), soft-label BCE with the reject class
  up-weighted (x6 in the paper's code);
- greedy (T = 0): the draft proposes argmax q, which is accepted iff it is argmax p. Label
  1[argmax q == argmax p] at each position of the target's own greedy continuations of corpus
  prefixes, the text a greedy decode verifies drafts against.
Any reject weight w is undone at save time (bias + log w), so both heads output calibrated
probabilities and a stop threshold means 1 - P(all drafts accepted). Draft and target are frozen:
features and labels are computed once and the loop trains only the heads. The greedy head's default
stop policy is chosen by replaying held-out greedy decoding under the engine's measured round costs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from specdec.models.artifacts import SpecdecError, UsageError, check_fingerprint, read_config, tokenizer_fingerprint, write_json
from specdec.decode.adaptive import StopPolicy
from specdec.models.acceptance import FEATURES, HEAD_MODES, N_STATS, AcceptanceHead, acceptance_features, greedy_features
from specdec.train.loop import TrainConfig, make_accelerator, run_training, save_config


# ---------------------------------------------------------------------------------------------
# Labels


def acceptance_labels(p_probs, q_probs, tokens):
    """min(1, p(x)/q(x)) per position: p_probs, q_probs [..., V] (same temperature), tokens [...].

    The probability that exact speculative sampling accepts a drafted x; 1 where q(x) = 0 is
    impossible for a drafted token but is clamped anyway (a target-chosen token q never proposed).
    """
    import torch

    px = p_probs.gather(-1, tokens[..., None]).squeeze(-1)
    qx = q_probs.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(qx > 0, (px / qx.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(px))


def propose_tokens(p_probs, q_probs, target_frac: float, generator):
    """The token judged at each position: sampled from q, or (target_frac of positions) from p."""
    import torch

    from_q, from_p = _sample(q_probs, generator), _sample(p_probs, generator)
    use_p = torch.rand(from_q.shape, generator=generator) < target_frac
    return torch.where(use_p, from_p, from_q), use_p


def _sample(probs, generator):
    """One token per row of ``probs`` [..., V] by inverting the CDF: exact, and several times faster on
    CPU than torch.multinomial over a whole block of positions (labelling's largest cost)."""
    import torch

    cdf = probs.float().cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def weighted_bce(logits, labels, reject_weight: float):
    """Soft-label BCE, the reject class weighted: -(y log s + w (1 - y) log(1 - s))."""
    import torch.nn.functional as F

    return -(labels * F.logsigmoid(logits) + reject_weight * (1 - labels) * F.logsigmoid(-logits)).mean()


def greedy_labels(p_logits, q_logits):
    """(tokens, labels) of greedy decoding: the draft proposes argmax q, accepted iff it is argmax p."""
    tokens = q_logits.argmax(-1)
    return tokens, (tokens == p_logits.argmax(-1)).float()


def label_blocks(draft, target, blocks, temperature: float, target_frac: float, seed: int, batch: int = 8, deadline: float | None = None,
                 modes: tuple[str, ...] = HEAD_MODES):
    """{"sampling": (features [N, F], label [N]), "greedy": (features, label)} over the judged positions
    of ``blocks`` (position t judges token t+1), both from the same two forwards.

    sampling: the draft's sample x (``target_frac`` of positions: the target's), label min(1, p(x)/q(x)).
    greedy: x = argmax q, label 1[argmax q == argmax p].
    With a ``deadline`` (a ``time.perf_counter()`` value) labelling stops at the first batch boundary
    after it, so a budgeted run spends its minutes on training rather than labelling the whole corpus.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {m: ([], []) for m in modes}
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            if deadline is not None and out[modes[0]][0] and time.perf_counter() > deadline:
                break
            ids = blocks[i : i + batch]["input_ids"].to(target.get_input_embeddings().weight.device)
            d = draft(input_ids=ids, output_hidden_states=True)
            hidden = d.hidden_states[-1][:, :-1]
            q_logits = d.logits.float()[:, :-1]  # position t proposes token t+1
            p_logits = target(input_ids=ids).logits.float()[:, :-1]
            q = torch.softmax(q_logits / temperature, -1)
            p = torch.softmax(p_logits / temperature, -1)
            tokens, _ = propose_tokens(p, q, target_frac, g)  # drawn in every mode: one random stream per seed
            if "sampling" in out:
                _append(out["sampling"], acceptance_features(hidden, q_logits, tokens), acceptance_labels(p, q, tokens))
            if "greedy" in out:
                g_tokens, g_labels = greedy_labels(p_logits, q_logits)
                _append(out["greedy"], acceptance_features(hidden, q_logits, g_tokens), g_labels)
    return {m: (torch.cat(f), torch.cat(y)) for m, (f, y) in out.items()}


def _append(acc, feats, labels):
    acc[0].append(feats.reshape(-1, feats.shape[-1]))
    acc[1].append(labels.flatten())


def build_features(draft, target, blocks, temperature: float, target_frac: float, seed: int, batch: int = 8, deadline: float | None = None):
    """(features [N, F], label [N]) of the sampling head (``label_blocks``' first half)."""
    return label_blocks(draft, target, blocks, temperature, target_frac, seed, batch, deadline, modes=("sampling",))["sampling"]


def target_continuations(target, blocks, prefix_len: int, new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         batch: int = 128, limit: int | None = None, deadline: float | None = None):
    """[N, prefix_len + new_tokens]: the first ``prefix_len`` tokens of each block followed by the target's
    own continuation (greedy at ``temperature`` 0, else sampled; no EOS stop), decoded by the engine's own
    loop (``ar``): the text a decode at that temperature verifies drafts against."""
    import torch

    from specdec.decode.engine import SpecEngine
    from specdec.decode.types import GenRequest
    from specdec.decode.verify import Sampling

    engine = SpecEngine(target, None, sampling=Sampling(temperature=temperature), seed=seed, eos_ids=[])
    n = len(blocks) if limit is None else min(limit, len(blocks))
    rows = []
    for i in range(0, n, batch):
        if deadline is not None and rows and time.perf_counter() > deadline:
            break
        ids = blocks[i : min(i + batch, n)]["input_ids"][:, :prefix_len].to(target.get_input_embeddings().weight.device)
        results = engine.generate([GenRequest(prompt_ids=row.tolist(), max_new_tokens=new_tokens) for row in ids])
        rows.append(torch.cat([ids, torch.tensor([r.token_ids for r in results], dtype=ids.dtype)], 1))
    return torch.cat(rows) if rows else torch.zeros(0, prefix_len + new_tokens, dtype=torch.long)


def label_continuations(draft, target, seqs, prefix_len: int, temperature: float = 0.0, seed: int = 0, batch: int = 32):
    """Head (features [N, L, F], labels [N, L]) on the continuation part of ``seqs``: index j judges token
    prefix_len + j. In a decode of the prefix, token prefix_len is the prefill's, so a round's first draft
    is judged at j = 1, its i-th at j = 1 + (tokens committed since) + i - 1.

    Greedy (``temperature`` 0): the draft proposes argmax q, label 1[argmax q == argmax p]. Sampling: the
    draft's own sample x ~ q at the temperature, label min(1, p(x)/q(x)), the chance that exact
    speculative sampling keeps it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    feats, labels = [], []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            ids = seqs[i : i + batch]
            d = draft(input_ids=ids, output_hidden_states=True)
            sl = slice(prefix_len - 1, ids.shape[1] - 1)
            q_logits = d.logits.float()[:, sl]
            p_logits = target(input_ids=ids).logits.float()[:, sl]
            if temperature > 0:
                q = torch.softmax(q_logits / temperature, -1)
                tokens = _sample(q, g)
                y = acceptance_labels(torch.softmax(p_logits / temperature, -1), q, tokens)
            else:
                tokens, y = greedy_labels(p_logits, q_logits)
            feats.append(acceptance_features(d.hidden_states[-1][:, sl], q_logits, tokens))
            labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def draw_acceptance(pred, chance, draws: int, seed: int):
    """(pred, 0/1 labels) with each row repeated ``draws`` times and every position accepted with its
    ``chance``: sampled rounds replayed as coin flips, ``draws`` per row for a steadier estimate."""
    import torch

    g = torch.Generator().manual_seed(seed)
    chance = chance.repeat(draws, 1)
    return pred.repeat(draws, 1), (torch.rand(chance.shape, generator=g) < chance).float()


class TensorDict:
    """A map-style dataset of equal-length tensors (one dict per item)."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}


def calibration(pred, labels, bins: int = 10) -> dict:
    """Brier score against the soft labels, a constant-predictor baseline, and reliability bins."""
    import torch

    brier = float(((pred - labels) ** 2).mean())
    base = float(((labels.mean() - labels) ** 2).mean())
    edges = torch.linspace(0, 1, bins + 1)
    table = []
    for b in range(bins):
        lo, hi = edges[b], edges[b + 1]
        sel = (pred >= lo) & ((pred < hi) if b < bins - 1 else (pred <= hi))
        if sel.any():
            table.append({"lo": float(lo), "hi": float(hi), "count": int(sel.sum()), "mean_pred": float(pred[sel].mean()), "mean_label": float(labels[sel].mean())})
    ece = sum(r["count"] * abs(r["mean_pred"] - r["mean_label"]) for r in table) / max(1, len(pred))
    return {"brier": brier, "brier_constant_baseline": base, "ece": ece, "reliability_bins": table, "mean_label": float(labels.mean())}


# ---------------------------------------------------------------------------------------------
# Default stop policies: decoding replayed on held-out continuations under measured round costs

THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MIN_DRAFTS = (0, 1, 2)
FIXED_KS = (1, 2, 3, 4, 6, 8)
# a stop rule must beat the best fixed length by this factor in simulation to be the default (choose_policy)
ADAPTIVE_MARGIN = 1.03
# prompts of a --policy-prompts file the real-round re-ranking decodes (onpolicy_greedy)
POLICY_PROMPTS = 24


def measure_round_costs(target, tokenizer, draft, head, prompts: list[list[int]], new_tokens: int = 48, reps: int = 3,
                        temperature: float = 0.0) -> dict:
    """Seconds per decode round at bs=1 through the real engine, one intra-op thread, greedy or sampling at
    ``temperature``: ``ar`` and the adaptive drafter held at n = 1, 2, 4 drafts (``head`` runs at every
    step, as in a real round).

    A speculative round of n drafts is fitted as alpha + beta * n; in units of an ``ar`` round (one
    target forward plus the loop's overhead) that is ``fixed`` + ``per_draft`` * n, which is what
    the policy simulation charges. A fixed-length round runs no head: ``head_per_draft`` is the head's
    share of a draft, timed directly (``time_head_per_draft``). It used to be the difference of two timed
    rounds, which on a busy machine came out as large as a draft forward and made long fixed lengths
    look free. The head's weights do not matter here, only its shape.
    """
    import statistics

    import torch

    ks = (1, 2, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    per_round: dict = {"ar": []} | {k: [] for k in ks}
    drafts_per_round: dict = {k: [] for k in ks}
    # head-judged rounds held at n drafts: min_draft 0 keeps the head running at every step (a policy with
    # min_draft == max_draft would skip it) and the threshold never stops a round early
    judged = lambda k: StopPolicy(1 - 1e-9, 0, k)  # noqa: E731
    engines = {k: _policy_engine(target, tokenizer, draft, head, None if k == "ar" else judged(k), temperature) for k in ("ar",) + ks}
    try:
        for _ in range(reps):  # configurations interleaved prompt by prompt, so drift of a shared machine hits them alike
            for k, tot in _decode_totals(engines, prompts, new_tokens).items():  # the prefill's time included (the same in every configuration)
                per_round[k].append(tot["wall"] / tot["rounds"])
                if k in ks:
                    drafts_per_round[k].append(tot["drafted"] / tot["rounds"])
        head_s = time_head_per_draft(draft, head, temperature)
    finally:
        torch.set_num_threads(threads)
    t_ar = statistics.median(per_round["ar"])
    xs = [statistics.mean(drafts_per_round[k]) for k in ks]
    ys = [statistics.median(per_round[k]) for k in ks]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    alpha = my - beta * mx
    per_draft = beta / t_ar
    return {"ar_round_s": t_ar, "spec_round_s": dict(zip(map(str, ks), ys)), "head_s": head_s,
            "fixed": alpha / t_ar, "per_draft": per_draft, "head_per_draft": min(head_s / t_ar, max(per_draft, 0.0)),
            "prompts": len(prompts), "new_tokens": new_tokens, "reps": reps, "temperature": temperature,
            "note": "per-round seconds at bs=1, one thread, at the temperature, through SpecEngine; a head-judged round of n drafts "
                    "costs fixed + per_draft * n ar rounds (least squares over n = 1, 2, 4); a fixed-length round, which "
                    "runs no head, costs head_per_draft * n less (the head's features, call and host read, timed alone)"}


def _policy_engine(target, tokenizer, draft, head, policy: StopPolicy | None, temperature: float):
    """The engine with ``draft`` drafting under ``policy`` (``head`` judging both modes); None: plain ``ar``."""
    from specdec.decode.adaptive import AdaptiveDrafter
    from specdec.decode.engine import SpecEngine
    from specdec.decode.verify import Sampling

    drafter = None if policy is None else AdaptiveDrafter(draft, head, policy.stop_threshold, policy.min_draft, policy.max_draft,
                                                          greedy_head=head, greedy_policy=policy)
    return SpecEngine(target, tokenizer, drafter, sampling=Sampling(temperature=temperature), eos_ids=[])


def _decode_totals(engines: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """{name: totals} for each engine decoding every prompt alone (bs=1), interleaved prompt by prompt (the
    order rotating), so a shared machine's drift hits every engine alike. Totals: wall seconds (prefill
    included), new tokens after the prefill's, target rounds after the prefill, drafted tokens and
    rounds that drafted at least one."""
    from specdec.decode.types import GenRequest

    names = list(engines)
    out = {name: dict.fromkeys(("wall", "tokens", "rounds", "drafted", "spec_rounds"), 0) for name in names}
    for i, p in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            tot = out[name]
            t0 = time.perf_counter()
            st = engines[name].generate([GenRequest(prompt_ids=p, max_new_tokens=new_tokens)])[0].stats
            tot["wall"] += time.perf_counter() - t0
            tot["tokens"] += st["new_tokens"] - 1  # the first new token comes from the prefill
            tot["rounds"] += st["target_calls"] - 1
            tot["drafted"] += st["drafted_tokens"]
            tot["spec_rounds"] += st["position_drafted"][0] if st["position_drafted"] else 0
    return out


def time_head_per_draft(draft, head, temperature: float, reps: int = 300) -> float:
    """Seconds the head adds to one drafted token, timed alone over ``reps`` calls: what a judged step
    computes beyond a fixed-length one (the features from the draft's hidden state and logits, the head,
    the read of its output on the host). On a GPU this under-counts: an idle stream syncs faster than
    one with the next draft forward queued behind the read."""
    import torch

    device = next(head.parameters()).device
    dtype = next(head.parameters()).dtype
    hidden = torch.randn(1, draft.config.hidden_size, device=device)
    logits = torch.randn(1, draft.config.vocab_size, device=device)
    score = head.fast() if hasattr(head, "fast") else head

    def step():
        if temperature == 0:
            feats = greedy_features(hidden, logits)[1]
        else:  # the sampled token is drawn in both kinds of round; only its features are the head's
            feats = acceptance_features(hidden, logits, logits.argmax(-1))
        return score(feats[None].to(dtype)).tolist()

    with torch.no_grad():
        for _ in range(10):
            step()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
    return (time.perf_counter() - t0) / reps


def onpolicy_greedy(target, tokenizer, draft, head, prompts: list[list[int]], sim: dict, costs: dict, new_tokens: int = 64,
                    n_adaptive: int = 3, n_fixed: int = 2, margin: float = ADAPTIVE_MARGIN) -> tuple[StopPolicy, dict]:
    """Re-rank the simulation's best greedy policies on real decodes: ``prompts`` decoded through the engine
    at T=0 under each (the ``n_adaptive`` best stop rules, the ``n_fixed`` best fixed lengths) and under
    ``ar``, interleaved prompt by prompt and timed; a candidate's ``speedup`` is its tokens/s over ``ar``'s.

    The simulation is wrong in two ways that the timing is not. Its replay is teacher-forced on the
    target's text, where a draft's misses are spread out; real rounds start right after a miss, where
    the next is likelier, so it overrates long rounds. And its cost model, a line fitted to head-judged
    rounds of 1, 2 and 4 drafts, misses what a judged round costs beyond the head (per-round work a
    fixed length skips) and the growth of the verify forward past 4 tokens. ``modelled_speedup`` keeps
    the model's estimate of each candidate's real rounds on record. The same margin as
    ``choose_policy`` applies. Returns (policy, {"candidates": [...], "chosen", "chosen_kind"}).
    """
    import torch

    ranked = sorted(sim["grid"], key=lambda r: -r["speedup"])[:n_adaptive]
    pols = [StopPolicy(r["stop_threshold"], r["min_draft"], r["max_draft"]) for r in ranked]
    pols += [StopPolicy(0.5, r["k"], r["k"]) for r in sorted(sim["fixed_k"], key=lambda r: -r["speedup"])[:n_fixed]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = {"ar": _policy_engine(target, tokenizer, draft, head, None, 0.0)}
        engines |= {i: _policy_engine(target, tokenizer, draft, head, pol, 0.0) for i, pol in enumerate(pols)}
        totals = _decode_totals(engines, prompts, new_tokens)
    finally:
        torch.set_num_threads(threads)
    ar_rate = totals["ar"]["tokens"] / max(totals["ar"]["wall"], 1e-9)
    rows = []
    for i, pol in enumerate(pols):
        tot = totals[i]
        rounds = max(tot["rounds"], 1)
        plain = tot["rounds"] - tot["spec_rounds"]  # min_draft 0: the head judged one draft, then a plain round (as simulated)
        cost = rounds_cost(costs["fixed"], per_draft_cost(costs, pol.fixed), tot["rounds"], tot["drafted"], plain)
        rows.append({**dataclasses.asdict(pol), "kind": "fixed" if pol.fixed else "adaptive", "tau": tot["tokens"] / rounds,
                     "drafts_per_round": tot["drafted"] / rounds, "speedup": tot["tokens"] / max(tot["wall"], 1e-9) / ar_rate,
                     "modelled_speedup": tot["tokens"] / max(cost, 1e-9)})
    best_a = max((r for r in rows if r["kind"] == "adaptive"), key=lambda r: r["speedup"])
    best_f = max((r for r in rows if r["kind"] == "fixed"), key=lambda r: r["speedup"])
    best = best_a if best_a["speedup"] >= margin * best_f["speedup"] else best_f
    policy = StopPolicy(best["stop_threshold"], best["min_draft"], best["max_draft"])
    return policy, {"candidates": rows, "chosen": dataclasses.asdict(policy), "chosen_kind": best["kind"],
                    "prompts": len(prompts), "new_tokens": new_tokens, "ar_tokens_per_s": ar_rate}


def per_draft_cost(costs: dict, fixed_length: bool) -> float:
    """A draft's cost in ``ar`` rounds (``measure_round_costs``): a fixed-length round runs no head, so its
    drafts cost the head's share less."""
    return costs["per_draft"] - (costs.get("head_per_draft", 0.0) if fixed_length else 0.0)


def rounds_cost(fixed: float, per_draft: float, rounds: int, drafted: int, plain: int) -> float:
    """Cost in ``ar`` rounds of ``rounds`` rounds that drafted ``drafted`` tokens: a round of n >= 1 drafts
    costs fixed + per_draft * n; a plain one (``plain`` of them) an ar round plus the draft forward that
    judged its one draft."""
    return (rounds - plain) * fixed + drafted * per_draft + plain * (1 + per_draft)


def simulate_rounds(pred, labels, fixed: float, per_draft: float, policy: StopPolicy | None = None, k: int | None = None) -> dict:
    """Decoding replayed on held-out continuations: ``pred``/``labels`` [N, L] are the head's P(accept)
    and whether the draft at each continuation index is accepted (0/1: ``label_continuations``' greedy
    labels, or ``draw_acceptance``'s coin flips of its sampling ones). Each row is decoded
    from index 1 in rounds: draft n tokens (fixed ``k``, or the adaptive ``policy`` on ``pred``), accept
    the leading accepted ones plus the target's token, pay ``fixed + per_draft * n`` (a plain round,
    n = 0 under min_draft 0: ``1 + per_draft``). Returns tokens per unit cost (units of an ``ar`` round:
    the estimated speedup over ``ar``), tau, mean drafts and the share of plain rounds.

    Approximation: after a rejected draft, the real drafter judges its own wrong continuation, the
    replay the target's text; that only moves where such a round stops (its cost), never its tokens.
    Sampling adds one: a kept draft is distributed as min(p, q) normalised, the replay's text as p.
    """
    logp = pred.double().clamp(min=1e-12).log().tolist()
    acc = labels.tolist()
    tokens = rounds = drafted = plain = 0
    log_floor = math.log1p(-policy.stop_threshold) if policy else 0.0
    for lp, a in zip(logp, acc):
        length, j = len(a), 1
        while j < length:
            room = length - j
            if policy is None:
                n = min(k, room)
            else:
                kmax, kmin = min(policy.max_draft, room), min(policy.min_draft, room)
                n, s = 0, 0.0
                while True:
                    s += lp[j + n]
                    n += 1
                    if n >= kmax or (n >= max(kmin, 1) and s < log_floor):
                        break
                if policy.min_draft == 0 and lp[j] < log_floor:
                    n = 0  # a plain round: the root alone, after the draft's one forward that judged it
            accepted = 0
            while accepted < n and a[j + accepted] > 0.5:
                accepted += 1
            tokens += accepted + 1
            drafted += n
            rounds += 1
            plain += n == 0
            j += accepted + 1
    cost = rounds_cost(fixed, per_draft, rounds, drafted, plain)
    return {"speedup": tokens / cost if cost else 0.0, "tau": tokens / max(rounds, 1), "drafts_per_round": drafted / max(rounds, 1),
            "plain_rounds": plain / max(rounds, 1)}


def choose_policy(pred, labels, costs: dict, max_draft: int = 20, margin: float = ADAPTIVE_MARGIN) -> tuple[StopPolicy, dict]:
    """The policy with the most simulated tokens per unit cost among the adaptive grid (stop threshold x
    min draft) and fixed lengths K (min_draft = max_draft = K, no head: charged ``head_per_draft`` less per
    draft). A fixed K wins where no stop rule on this head pays for the head and the longer rounds it
    asks for, and also unless the best stop rule beats it by ``margin``: the round costs are timed on a
    busy machine and the replay is teacher-forced, so a smaller edge is noise, while a fixed length runs
    no head (no per-draft host sync, which a GPU pays dearly). ``chosen_kind`` says which family won,
    and the best of the other stays on record."""
    grid = []
    for m in MIN_DRAFTS:
        for thr in THRESHOLDS:
            pol = StopPolicy(thr, m, max_draft)
            grid.append({"stop_threshold": thr, "min_draft": m, "max_draft": max_draft,
                         **simulate_rounds(pred, labels, costs["fixed"], costs["per_draft"], policy=pol)})
    fixed_k = [{"k": k, **simulate_rounds(pred, labels, costs["fixed"], per_draft_cost(costs, True), k=k)} for k in FIXED_KS]
    # the same policies under a perfect head (P = the labels): how much a better head could give
    oracle = simulate_rounds(labels.clamp(1e-6, 1 - 1e-6), labels, costs["fixed"], costs["per_draft"], policy=StopPolicy(0.5, 0, max_draft))
    best = max(grid, key=lambda r: r["speedup"])
    best_fixed = max(fixed_k, key=lambda r: r["speedup"])
    if best["speedup"] < margin * best_fixed["speedup"]:
        policy, kind = StopPolicy(0.5, best_fixed["k"], best_fixed["k"]), "fixed"
    else:
        policy, kind = StopPolicy(best["stop_threshold"], best["min_draft"], best["max_draft"]), "adaptive"
    return policy, {"grid": grid, "fixed_k": fixed_k, "oracle_head": oracle, "chosen": dataclasses.asdict(policy), "chosen_kind": kind,
                    "best_adaptive": best, "best_fixed": best_fixed, "adaptive_margin": margin}


# ---------------------------------------------------------------------------------------------
# Training


def train_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    data_files: list[str | Path],
    out_dir: str | Path,
    cfg: TrainConfig,
    num_layers: int = 3,
    reject_weight: float = 6.0,
    target_token_frac: float = 0.15,
    temperature: float = 1.0,
    greedy_reject_weight: float = 1.0,
    greedy_prefix: int = 64,
    greedy_new_tokens: int = 128,
    greedy_sequences: int = 1024,
    cost_new_tokens: int = 48,
    cost_reps: int | None = None,
    policy_prompts: str | Path | None = None,
    resume: bool = False,
    placement=None,
) -> dict:
    """Train the sampling head and the greedy head of one acceptance artifact; choose each mode's default
    stop policy by simulation (``choose_policy``) under the engine's measured round costs: the greedy
    one on the target's held-out greedy continuations, the sampling one on its continuations sampled at
    ``temperature`` (the artifact's temperature: its head's labels and its policy are for that one).

    Greedy head data: the target's own greedy continuations of ``greedy_prefix``-token block prefixes,
    the text a greedy decode verifies drafts against. (Adding the corpus text's greedy labels made the
    head worse on held-out greedy text: the features cannot tell the two texts apart, and the target
    agrees with its draft more often on its own repetitive output; its calibration on held-out corpus
    text is still reported.) Budget: ~20% labels the corpus, ~20% generates
    and labels continuations, ~15% held-out data, a few seconds measure round costs, the rest trains
    the two heads (half each). Round costs: ``cost_reps`` interleaved timings (default 3; 1 under a
    budget below 90 s) of 4 held-out prompts decoding ``cost_new_tokens`` tokens each.

    ``policy_prompts``: a prompts JSONL like the ones the artifact will decode (decode's input format).
    The greedy policy's real-round re-ranking (``onpolicy_greedy``) runs on its first
    ``POLICY_PROMPTS`` prompts instead of held-out block prefixes: prefixes cut from the training text
    are text the target has seen, where it agrees with its draft more than after a user's prompt.
    """
    import torch
    from safetensors.torch import save_file

    from specdec.models.loading import Placement, input_device, load_draft
    from specdec.train.data import load_blocks, load_teacher

    if temperature <= 0 or not 0 <= target_token_frac <= 1 or reject_weight <= 0 or greedy_reject_weight <= 0:
        raise UsageError("temperature and reject weights must be > 0 and target_token_frac in [0, 1]")
    out_dir = Path(out_dir)
    target, tokenizer = load_teacher(target_dir, placement, make_accelerator(cfg))
    fp = tokenizer_fingerprint(tokenizer)
    dcfg = read_config(draft_dir)
    if "specdec_target" in dcfg:
        check_fingerprint(dcfg["specdec_target"], fp, f"draft {draft_dir}")
    draft = load_draft(draft_dir, placement or Placement(), device=input_device(target), dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(f"draft {draft_dir} has vocabulary size {draft.config.vocab_size}, the target {target.config.vocab_size}")
    user_prompts = read_policy_prompts(policy_prompts, tokenizer) if policy_prompts else None
    train_blocks, held_blocks = load_blocks(data_files, tokenizer, cfg.seq_len, cfg.heldout, cfg.seed)
    # the budget starts after loading: reading and tokenising the corpus is a fixed cost (10+ s for the
    # default family's) that would otherwise eat a small budget's labelling share whole
    start = time.perf_counter()
    budget_s = cfg.budget_minutes * 60

    def until(frac):
        return start + frac * budget_s if budget_s else None

    prefix = max(1, min(greedy_prefix, cfg.seq_len // 2))
    new = max(2, min(greedy_new_tokens, int(getattr(target.config, "max_position_embeddings", 1 << 20)) - prefix))
    data = label_blocks(draft, target, train_blocks, temperature, target_token_frac, cfg.seed, deadline=until(0.2), modes=("sampling",))
    cont = target_continuations(target, train_blocks, prefix, new, limit=greedy_sequences, deadline=until(0.4))
    cont_h, cont_y = label_continuations(draft, target, cont, prefix)
    data["greedy"] = (cont_h.flatten(0, 1), cont_y.flatten())
    if len(held_blocks) == 0:
        raise UsageError("train-acceptance needs held-out blocks for calibration and the stop policy (heldout > 0)")
    held = label_blocks(draft, target, held_blocks, temperature, target_token_frac, cfg.seed + 1, deadline=until(0.45))
    n_held = max(16, greedy_sequences // 8)
    held_cont = target_continuations(target, held_blocks, prefix, new, limit=n_held, deadline=until(0.5))
    held_h, held_y = label_continuations(draft, target, held_cont, prefix)
    held_samp = target_continuations(target, held_blocks, prefix, new, temperature, cfg.seed + 2, limit=n_held, deadline=until(0.55))
    held_sh, held_sy = label_continuations(draft, target, held_samp, prefix, temperature, cfg.seed + 3)

    torch.manual_seed(cfg.seed)
    hidden = draft.config.hidden_size
    heads = {m: AcceptanceHead(hidden + N_STATS, num_layers) for m in HEAD_MODES}
    weights = {"sampling": reject_weight, "greedy": greedy_reject_weight}
    if budget_s:  # the two heads share what is left, half each, after a reserve for measuring both modes' round costs
        left = max(budget_s - (time.perf_counter() - start) - 0.15 * budget_s, 0.2 * budget_s)
        cfg = dataclasses.replace(cfg, budget_minutes=left / 2 / 60)

    trained, results = {}, {}
    for mode in HEAD_MODES:
        h_train, y_train = data[mode]
        w = weights[mode]

        def loss_fn(model, batch, w=w):
            return weighted_bce(model(batch["h"]).float(), batch["y"], w)

        sub = out_dir if mode == "sampling" else out_dir / "greedy-head"  # each head's checkpoints
        result = run_training(cfg, heads[mode], loss_fn, TensorDict(h=h_train, y=y_train), sub, resume=resume,
                              accelerator=make_accelerator(cfg), label=f"{mode} head")
        results[mode] = result
        if result.is_main:
            head = result.model.float()
            with torch.no_grad():
                # weighted BCE's optimum is odds(s) = odds(y) / w; the saved head adds log w back (calibrated)
                head.out.bias += math.log(w)
            trained[mode] = head
    if not results["sampling"].is_main:
        return {}
    n_prompts = min(4, len(held_cont))
    if cost_reps is None:
        cost_reps = 3 if not budget_s or budget_s >= 90 else 1
    cost_prompts = [row[:prefix].tolist() for row in held_cont[:n_prompts]]
    costs = {mode: measure_round_costs(target, tokenizer, draft, trained[mode], cost_prompts, new_tokens=cost_new_tokens,
                                       reps=cost_reps, temperature=0.0 if mode == "greedy" else temperature)
             for mode in HEAD_MODES}

    with torch.no_grad():
        h_s, y_s = held["sampling"]
        pred_s = torch.sigmoid(trained["sampling"](h_s))
        raw_s = torch.sigmoid(trained["sampling"](h_s) - math.log(reject_weight))
        pred_g = torch.sigmoid(trained["greedy"](held_h))  # [N, L] along held-out greedy text
        pred_gc = torch.sigmoid(trained["greedy"](held["greedy"][0]))
        pred_ss = torch.sigmoid(trained["sampling"](held_sh))  # [N, L] along held-out sampled text
    sampling = calibration(pred_s, y_s)
    sampling["uncorrected_brier"] = float(((raw_s - y_s) ** 2).mean())
    greedy = calibration(pred_g.flatten(), held_y.flatten())
    greedy["corpus_text"] = {k: v for k, v in calibration(pred_gc, held["greedy"][1]).items() if k != "reliability_bins"}
    policies, sims = {}, {}
    policies["greedy"], sims["greedy"] = choose_policy(pred_g, held_y, costs["greedy"])
    # greedy rounds are deterministic: the simulation's best few are re-ranked on real rounds
    onpolicy_prompts = user_prompts or [row[:prefix].tolist() for row in held_cont[n_prompts : n_prompts + 8]] or cost_prompts
    policies["greedy"], sims["greedy"]["onpolicy"] = onpolicy_greedy(target, tokenizer, draft, trained["greedy"], onpolicy_prompts,
                                                                      sims["greedy"], costs["greedy"])
    sims["greedy"]["onpolicy"]["prompts_from"] = str(policy_prompts) if user_prompts else "held-out block prefixes"
    sims["greedy"]["chosen"], sims["greedy"]["chosen_kind"] = sims["greedy"]["onpolicy"]["chosen"], sims["greedy"]["onpolicy"]["chosen_kind"]
    # sampled rounds replayed as coin flips with each draft's chance min(1, p/q), 8 draws per continuation
    policies["sampling"], sims["sampling"] = choose_policy(*draw_acceptance(pred_ss, held_sy, 8, cfg.seed + 4), costs["sampling"])
    sims["sampling"]["temperature"] = temperature
    metrics = dict(sampling)  # top level: the sampling head, as in the one-head format
    metrics.update(
        kind="acceptance", heads=list(HEAD_MODES), sampling=sampling, greedy=greedy,
        steps={m: r.steps for m, r in results.items()}, stopped={m: r.stopped for m, r in results.items()},
        train_wall_s={m: round(r.wall_s, 3) for m, r in results.items()},
        loss_curve={m: r.losses for m, r in results.items()},
        train_positions={m: len(data[m][1]) for m in HEAD_MODES}, heldout_positions={"sampling": len(y_s), "greedy": int(held_y.numel())},
        greedy_text={"prefix_tokens": prefix, "new_tokens": new, "train_sequences": len(cont), "heldout_sequences": len(held_cont)},
        sampled_text={"temperature": temperature, "heldout_sequences": len(held_samp)},
        round_costs=costs, policy_simulation=sims,
        note="sampling: Brier against the soft labels min(1, p/q) on held-out draft samples (T=%g); training up-weights the "
             "reject class by w and the saved head's output bias includes + log w, which undoes that shift (uncorrected_brier "
             "is the head without it). greedy: labels 1[argmax q == argmax p] on the target's greedy continuations of held-out "
             "block prefixes (corpus_text: on held-out corpus text). policy_simulation: per mode, decoding replayed on the "
             "target's held-out continuations (greedy; sampled at T=%g, each draft kept with its chance min(1, p/q), 8 draws) "
             "under that mode's round_costs; the chosen policies are the artifact's defaults" % (temperature, temperature),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {f"{m}.{k}": v.detach().float().contiguous() for m, head in trained.items() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"))
    write_json(out_dir / "config.json", {
        "kind": "acceptance", "target": fp,
        "draft": {"path": str(Path(draft_dir).resolve()), "fingerprint": dcfg.get("specdec_target", fp), "hidden_size": hidden},
        "hidden_size": hidden, "features": FEATURES, "input_size": hidden + N_STATS, "num_layers": num_layers,
        "heads": list(HEAD_MODES), "reject_weight": {"sampling": reject_weight, "greedy": greedy_reject_weight},
        "target_token_frac": target_token_frac, "temperature": temperature,
        "policy": {mode: dataclasses.asdict(policies[mode]) for mode in HEAD_MODES},
    })
    save_config(cfg, out_dir, {"trainer": "acceptance", "target": str(target_dir), "draft": str(draft_dir), "data": [str(f) for f in data_files]})
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def read_policy_prompts(path: str | Path, tokenizer, limit: int = POLICY_PROMPTS) -> list[list[int]]:
    """Token ids of the first ``limit`` usable prompts of a prompts JSONL (decode's input format)."""
    from specdec.decode.io import read_records
    from specdec.decode.job import encode_record

    if not Path(path).exists():
        raise UsageError(f"no such prompts file: {path}")
    out = []
    for rec in read_records(path):
        if rec.error:
            raise UsageError(f"{path}:{rec.line}: {rec.error}")
        try:
            ids = encode_record(tokenizer, rec)
        except ValueError as exc:  # e.g. messages without a chat template
            raise UsageError(f"{path}:{rec.line}: cannot tokenize: {exc}") from exc
        if ids:
            out.append(ids)
        if len(out) >= limit:
            break
    if not out:
        raise UsageError(f"{path} holds no prompts")
    return out
