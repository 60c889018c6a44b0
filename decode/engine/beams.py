"""Beam search, and Diverse Beam Search (Vijayakumar et al., 2016), with a loop of their own.

``--beams B`` keeps the B most likely continuations of a prompt, scored as transformers' beam search
scores them (``GenerationMixin._beam_search`` with ``length_penalty=1.0`` and ``early_stopping=False``):
at each step every running beam's next-token log-probabilities are added to its score, the top 2×B
candidates are taken, those among the top B that end (EOS, a stop string, or the budget) join the
finished set with their score divided by their generated length (EOS included), and the best B that do
not end run on. A request is done when none of the running beams could, by transformers' heuristic,
beat the worst of B finished hypotheses (the best running score divided by the current length is no
better), or when every candidate has ended. Its B finished hypotheses are returned best first, each
with that score (transformers' ``sequences_scores``). Log-probabilities are taken in float32, as
transformers takes them.

``--beam-groups G`` splits the beams into G groups of B/G decoded in turn at each step (Diverse Beam
Search): group g's log-probabilities are lowered by ``--diversity-penalty`` λ for each beam of the
groups before it that chose the token at this step (Hamming diversity), and the lowered scores
accumulate in the group's beam scores, as transformers' group beam search accumulated them. Each group
keeps its own finished set and stops on its own; the B hypotheses are then sorted by score together.
With G = 1 this is plain beam search; with λ = 0 each group is an independent beam search of B/G beams
(the groups then find the same hypotheses).

Drafting does not feed the beams (``--beams`` refuses any drafter): a speculative draft saves target
forwards by proposing the one token the target would take, but every beam step needs the target's
whole next-token distribution at every beam to rank all B×V candidates, and the beams are reordered
after each step, so there is no run of tokens a draft could have the target verify at once.

The target runs with a transformers ``DynamicCache``: the prompt is prefilled once (one row), and the
cache is reordered by beam (``DynamicCache.reorder_cache``) before each step's forward of one token per
running beam; a group that is done leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.types import GenRequest, GenResult

LENGTH_PENALTY = 1.0  # transformers' default: a finished hypothesis scores sum(log p) / length ** 1.0
_NEG = -1.0e9  # transformers' score of a slot that must not be chosen


@dataclass
class Hypothesis:
    """A finished beam: its new tokens (EOS included), length-normalised score, finish reason."""

    tokens: list[int]
    score: float
    finish: str


class _Group:
    """One group's running beams (token lists, float32 scores, rows of the cache) and finished set."""

    def __init__(self, size: int, device):
        self.size = size
        self.seqs: list[list[int]] = [[] for _ in range(size)]
        # only the first beam is live at the start (transformers' -1e9), so the top 2k come from one row
        self.scores = torch.full((size,), _NEG, dtype=torch.float32, device=device)
        self.scores[0] = 0.0
        self.rows = torch.zeros(size, dtype=torch.long, device=device)  # every beam reads the prefill's row
        self.parents = self.rows
        self.finished: list[Hypothesis] = []
        self.done = False


class BeamSearch(OwnLoop):
    """B beams in G groups over the target (see the module's docstring); one request at a time."""

    expands_samples = True  # a record's B outputs come from one request (the job also checks --beams itself)

    def __init__(self, target, tokenizer, options):
        super().__init__(target, tokenizer, options)
        sampling = options.sampling
        self.beams = int(sampling.beams)
        self.groups = int(sampling.beam_groups)
        if self.beams < 1 or self.groups < 1 or self.beams % self.groups:
            raise ValueError(f"beam_groups ({self.groups}) must divide beams ({self.beams})")
        self.penalty = float(sampling.diversity_penalty)

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        with self.output_layer():  # exact log-probabilities: they are the beams' scores
            return [self.decode(req) for req in requests]

    def decode(self, req: GenRequest) -> GenResult:
        """One request's B outputs: the best as the result, the others best first as its alternatives."""
        groups, calls = self.search(req.prompt_ids, req.max_new_tokens)
        hyps = sorted((h for g in groups for h in g), key=lambda h: -h.score)
        results = [GenResult(list(h.tokens), h.finish, {"new_tokens": len(h.tokens)}, score=h.score) for h in hyps]
        best = results[0]
        best.stats.update(target_calls=calls, beams=self.beams, beam_groups=self.groups)
        best.alternatives = results[1:]
        return best

    def _ends(self, tokens: list[int], max_new: int) -> str | None:
        """Why an output of ``tokens`` ends (as ``OwnLoop.append`` would say), or None."""
        if tokens[-1] in self.eos_ids:
            return "stop"
        if len(tokens) >= max_new:
            return "length"
        if self.stop and any(s in self.tokenizer.decode(tokens[-32:]) for s in self.stop):
            return "stop"
        return None

    @torch.inference_mode()
    def search(self, prompt_ids: list[int], max_new: int) -> tuple[list[list[Hypothesis]], int]:
        """Each group's finished hypotheses (best first) for one prompt, and the target forwards made."""
        from transformers import DynamicCache

        k = self.beams // self.groups
        groups = [_Group(k, self.device) for _ in range(self.groups)]
        if max_new < 1:
            return [[Hypothesis([], 0.0, "length") for _ in range(k)] for _ in groups], 0
        cache = DynamicCache(config=self.target.config)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        logits = self._forward(ids, cache)
        calls = 1
        step = 0
        while True:
            step += 1
            counts = None  # tokens the earlier groups' beams chose at this step
            for g in groups:
                if g.done:
                    continue
                chosen = self._step(g, logits, counts, step, max_new)
                if self.penalty and self.groups > 1:
                    if counts is None:
                        counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=self.device)
                    counts += torch.bincount(chosen, minlength=logits.shape[-1]).to(counts.dtype)
            live = [g for g in groups if not g.done]
            if not live:
                break
            # the next cache: each live group's beams, in order, copied from the rows their parents held
            index = torch.cat([g.rows[g.parents] for g in live])
            cache.reorder_cache(index)
            for i, g in enumerate(live):
                g.rows = torch.arange(i * k, (i + 1) * k, device=self.device)
            ids = torch.tensor([[s[-1]] for g in live for s in g.seqs], dtype=torch.long, device=self.device)
            logits = self._forward(ids, cache)
            calls += 1
        return [g.finished for g in groups], calls

    def _forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """The target's next-token logits (float32, as transformers scores beams) after ``ids``."""
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].to(dtype=torch.float32)

    def _step(self, g: _Group, logits: torch.Tensor, counts: torch.Tensor | None, step: int, max_new: int) -> torch.Tensor:
        """Advance group ``g`` by one token (transformers' ``_get_top_k_continuations``,
        ``_update_finished_beams``, ``_get_running_beams_for_next_iteration`` and early-stop heuristic);
        returns the tokens its beams took at this step."""
        k = g.size
        log_probs = torch.log_softmax(logits[g.rows], dim=-1)
        if counts is not None:
            log_probs = log_probs - self.penalty * counts  # Hamming diversity against the earlier groups
        vocab = log_probs.shape[-1]
        flat = (log_probs + g.scores[:, None]).reshape(-1)
        top, index = torch.topk(flat, min(2 * k, flat.numel()))
        parents = (index // vocab).tolist()
        tokens = (index % vocab).tolist()
        seqs, ends = [], []
        for p, t in zip(parents, tokens):
            seq = g.seqs[p] + [t]
            seqs.append(seq)
            ends.append(self._ends(seq, max_new))
        hit = torch.tensor([e is not None for e in ends], device=top.device)
        # only the top k candidates may finish; the rest are there so that k beams run on
        normalised = top / (step ** LENGTH_PENALTY)
        new = [Hypothesis(seqs[r], float(normalised[r]), ends[r]) for r in range(min(k, len(seqs))) if ends[r] is not None]
        if new:
            g.finished = sorted(g.finished + new, key=lambda h: -h.score)[:k]
        running = top + hit.to(top.dtype) * _NEG
        keep = torch.topk(running, k).indices
        g.scores = running[keep]
        keep = keep.tolist()
        g.seqs = [seqs[r] for r in keep]
        g.parents = torch.tensor([parents[r] for r in keep], dtype=torch.long, device=self.device)
        if bool(hit.all()):
            g.done = True  # no candidate can go on (the budget)
        elif len(g.finished) == k:
            # transformers' early_stopping=False heuristic: the best running beam at its current length
            best_running = g.scores[0] / (step ** LENGTH_PENALTY)
            g.done = not bool(best_running > torch.tensor(g.finished[-1].score, dtype=torch.float32, device=top.device))
        # the tokens its beams took, for the later groups' penalty: the best k candidates that did not end
        # by EOS or a stop string (at the budget's step too, where every candidate ends and none runs on)
        took = [seqs[r][-1] for r in range(len(seqs)) if ends[r] != "stop"][:k]
        return torch.tensor(took, dtype=torch.long, device=self.device)
