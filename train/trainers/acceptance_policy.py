"""Default stop policies of the acceptance heads: decoding replayed on held-out continuations under
the engine's measured round costs (``simulate_rounds``, ``choose_policy``), and, for greedy decoding,
the simulation's best candidates re-ranked on real rounds (``onpolicy_greedy``)."""

from __future__ import annotations

import dataclasses
import math
import time

from specdec.decode.drafters.adaptive import StopPolicy
from specdec.models.acceptance import acceptance_features, greedy_features

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
    share of a draft, timed directly (``time_head_per_draft``), since the difference of two timed rounds
    is dominated by a busy machine's noise and would make long fixed lengths look free. The head's
    weights do not matter here, only its shape.
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
    from specdec.decode.drafters.adaptive import AdaptiveDrafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.verify import Sampling

    drafter = None if policy is None else AdaptiveDrafter(draft, head, policy.stop_threshold, policy.min_draft, policy.max_draft,
                                                          greedy_head=head, greedy_policy=policy)
    return SpecEngine(target, tokenizer, drafter, sampling=Sampling(temperature=temperature), eos_ids=[])


def _decode_totals(engines: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """{name: totals} for each engine decoding every prompt alone (bs=1), interleaved prompt by prompt (the
    order rotating), so a shared machine's drift hits every engine alike. Totals: wall seconds (prefill
    included), new tokens after the prefill's, target rounds after the prefill, drafted tokens and
    rounds that drafted at least one."""
    from specdec.decode.engine.types import GenRequest

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
