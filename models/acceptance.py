"""The SpecDec++ acceptance head: its module, the features it reads, and its artifact loader.

A head predicts P(draft token accepted | earlier drafts accepted) from what the draft knows when it
proposes the token: its last hidden state at the position that produced q, and three statistics of q
there. One artifact holds two heads, one per decode mode (``HEAD_MODES``): "accepted" means
min(1, p(x)/q(x)) when sampling and 1[argmax q == argmax p] when greedy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.models.artifacts import load_weights, read_config
from specdec.models.errors import SpecdecError
from specdec.models.heads import ResBlock

FEATURES = "prev-hidden+q-stats"  # recorded in the artifact; decode refuses heads that read anything else
N_STATS = 3
HEAD_MODES = ("sampling", "greedy")  # greedy: T = 0, label 1[argmax q == argmax p]


def acceptance_features(hidden, logits, tokens):
    """[..., H + 3]: the draft's hidden state where it proposed ``tokens`` and, from its logits there
    (softmax at T=1), q(token), max q and the entropy of q. Training and decoding both call this."""
    logq = torch.log_softmax(logits.float(), -1)
    q = logq.exp()
    # entropy as -sum q log q with log q clamped finite (q = 0 then adds 0): xlogy's cost, without xlogy
    entropy = -(q * logq.clamp(min=torch.finfo(logq.dtype).min)).sum(-1)
    stats = torch.stack([q.gather(-1, tokens[..., None]).squeeze(-1), q.max(-1).values, entropy], -1)
    return torch.cat([hidden.float(), stats], -1)


def greedy_features(hidden, logits):
    """(argmax tokens, ``acceptance_features`` of them) in fewer ops, for the per-step greedy path: with
    x = argmax q, q(x) = max q = exp(max logit - logsumexp), entropy = logsumexp - E_q[logit]."""
    logits = logits.float()
    top, tokens = logits.max(-1)
    lse = torch.logsumexp(logits, -1)
    q_max = torch.exp(top - lse)
    entropy = lse - (torch.exp(logits - lse[..., None]) * logits).sum(-1)
    return tokens, torch.cat([hidden.float(), torch.stack([q_max, q_max, entropy], -1)], -1)


class AcceptanceHead(nn.Module):
    """ResBlock x num_layers then Linear(H, 1): a logit of P(accept)."""

    def __init__(self, hidden: int, num_layers: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
        self.out = nn.Linear(hidden, 1)

    def forward(self, h):
        return self.out(self.blocks(h)).squeeze(-1)

    def fast(self):
        """``forward`` as a plain function of the current weights, for decoding: the head runs once per
        drafted token, where nn.Module call overhead is most of its cost. No gradients."""
        silu = torch.nn.functional.silu
        blocks = [(b.linear.bias.detach(), b.linear.weight.detach().t().contiguous()) for b in self.blocks]
        bias, weight = self.out.bias.detach(), self.out.weight.detach().t().contiguous()

        def run(h):
            x = h.reshape(-1, h.shape[-1])
            for b, w in blocks:
                x = x + silu(torch.addmm(b, x, w))
            return torch.addmm(bias, x, weight).reshape(h.shape[:-1])

        return run


def load_acceptance_heads(acceptance_dir: str | Path) -> tuple[dict, dict]:
    """({mode: head}, config) from an acceptance artifact; weights through safetensors only."""
    cfg = read_config(acceptance_dir)
    if cfg.get("kind") != "acceptance":
        raise SpecdecError(f"{acceptance_dir} is not an acceptance artifact (kind {cfg.get('kind')!r})")
    if cfg.get("features") != FEATURES or sorted(cfg.get("heads") or []) != sorted(HEAD_MODES):
        raise SpecdecError(f"{acceptance_dir} is not an acceptance artifact of this version of specdec "
                           f"(features {cfg.get('features')!r}, heads {cfg.get('heads')!r}); retrain it with `specdec train-acceptance`")
    state = load_weights(acceptance_dir)
    heads = {}
    for mode in HEAD_MODES:
        head = AcceptanceHead(int(cfg["input_size"]), int(cfg.get("num_layers", 3)))
        head.load_state_dict({k[len(mode) + 1 :]: v for k, v in state.items() if k.startswith(mode + ".")})
        heads[mode] = head.eval().requires_grad_(False)
    return heads, cfg
