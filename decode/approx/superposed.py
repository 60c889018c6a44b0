"""Superposed Decoding (Shen et al. 2024, "Superposed Decoding: Multiple Generations from a Single
Autoregressive Inference Pass"): ``--drafter superposed --num-samples k`` gives k drafts of a prompt for
the cost of one forward per step. Approximate: records say ``"approximate": true``.

The method. The prompt is prefilled once; its next-token top-k are the k first drafts. At each later
step the model's input is not a token but the *superposition* of the k drafts' last tokens: the sum of
their input embeddings (the output of the model's own ``get_input_embeddings()`` module, so a scale an
architecture applies there, as Gemma's ``GemmaTextScaledWordEmbedding`` does, is kept; in transformers
5 every architecture that scales applies it in that module, and ``inputs_embeds`` is what the model's
forward would have computed from token ids), weighted by the drafts' probabilities normalised to sum 1.
One KV cache holds the one superposed sequence (a ``DynamicCache``). From the step's next-token
distribution p_model the top-k tokens j are taken, and the k x k candidates "draft i extended by j" are
scored

    score(i, j) = P(draft i) * ((1 - w) * p_model(j) + w * p_ngram(j | draft i's last n-1 tokens)),

the best k (distinct by construction: distinct parents, distinct tokens) becoming the new drafts.

Why it is lossy. Only the first token of each draft comes from a distribution the model computed for
that draft's own text. From the second step on, every draft is extended from one distribution computed
on a blend of all the drafts' embeddings (a point in embedding space that is no token's), so a draft is
not what the target would write after it, greedy or sampled, and its score is not its probability
under the target; the n-gram model, which sees each draft's own last tokens, is what tells the drafts'
continuations apart (the paper relies on it to keep drafts coherent). With k = 1 and w = 0 the
superposition is the one draft's own embedding and the method is exactly greedy decoding.

Choices made here.

- The n-gram model (``NGramModel``) is interpolated Witten-Bell (not stupid backoff: it is a proper
  distribution, so the interpolation with p_model stays one), of order ``--max-ngram`` (n, default 3)
  down to unigrams over a uniform base (1 / vocabulary). Its counts are the token ids of every prompt this
  decoder has seen, the current one included (the most recent ``CORPUS_TOKENS`` tokens of prompts:
  older prompts' counts are subtracted again, so a long job's memory stays bounded), plus, for each
  draft, the n-grams of its own generated text (n-grams ending in it, their contexts reaching into the
  prompt).
- ``--ngram-weight`` w defaults to ``DEFAULT_NGRAM_WEIGHT`` = 0.3 (the brief's 0.2-0.5; a weight near
  the paper's, where the n-gram model helps without overruling the target). The first step is scored
  the same way (one parent, the prompt, of probability 1), which only changes the first drafts' scores.
- A draft finishes as the engine's rows do (``OwnLoop.append``: EOS, the budget, a stop string). A
  finished draft keeps its slot and its score for good (as a finished beam does): it is no longer
  extended, and it leaves the superposition, whose weights are renormalised over the drafts still
  going; those fill the remaining k - f slots. Decoding ends when every draft has finished. All drafts
  grow in lockstep, so the length budget ends them at the same step.
- Outputs are ranked by their log-score (the sum of the logs of the interpolated probabilities; no
  length normalisation, so a draft that ended early on EOS may rank first), best first: the primary
  result is the best, ``alternatives`` the rest, each with its ``score``. Forwards (``target_calls``:
  the prefill and one per step, whatever k) are counted once, in the primary's stats.
- One request at a time (``generate`` decodes its requests in turn): the method's batch is its k drafts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.types import GenRequest, GenResult
from specdec.models.errors import SpecdecError, UsageError

DEFAULT_NGRAM_WEIGHT = 0.3
CORPUS_TOKENS = 1 << 17  # prompt tokens the n-gram counts hold at most (the most recent prompts')


def check_spec(spec: str) -> None:
    """``superposed`` takes nothing after a colon: its options are --num-samples (k), --ngram-weight, --max-ngram."""
    if spec != "superposed":
        raise UsageError(f"--drafter {spec}: superposed decoding takes no ':PART' (set k with --num-samples, "
                         "the n-gram model with --ngram-weight)")


def build(spec: str, target, tokenizer, options) -> "SuperposedDecoder":
    """The registry's factory for ``--drafter superposed``."""
    check_spec(spec)
    return SuperposedDecoder(target, tokenizer, options)


class NGramModel:
    """Interpolated Witten-Bell n-gram model of order ``order`` over a bounded corpus of token sequences.

    P(j | c) = (C(c j) + D(c) * P(j | c')) / (C(c) + D(c)), with C the counts, D(c) the number of distinct
    tokens seen after c, c' the context less its first token; the empty context backs off to 1 / vocab.
    A context never seen leaves the lower order's estimate as it is. ``prob`` adds, to the corpus'
    counts, the n-grams of the query sequence from ``start`` on (a draft's own text)."""

    def __init__(self, order: int = 3, limit: int = CORPUS_TOKENS):
        self.order = max(1, int(order))
        self.limit = limit
        self.grams: dict[tuple, int] = {}  # context + (token,) -> count
        self.contexts: dict[tuple, list[int]] = {}  # context -> [count, distinct next tokens]
        self.docs: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, seq: list[int]) -> None:
        """Count ``seq``'s n-grams; the oldest sequences' counts are dropped while the corpus is over its
        limit (the newest is always kept)."""
        seq = list(seq)
        self._count(seq, 1)
        self.docs.append(seq)
        self.tokens += len(seq)
        while self.tokens > self.limit and len(self.docs) > 1:
            old = self.docs.popleft()
            self._count(old, -1)
            self.tokens -= len(old)

    def _count(self, seq: list[int], sign: int) -> None:
        for p, tok in enumerate(seq):
            for m in range(min(self.order - 1, p) + 1):
                ctx = tuple(seq[p - m : p])
                gram = ctx + (tok,)
                count = self.grams.get(gram, 0) + sign
                stats = self.contexts.setdefault(ctx, [0, 0])
                stats[0] += sign
                if count == 0:
                    del self.grams[gram]
                    stats[1] -= 1
                else:
                    self.grams[gram] = count
                    if count == 1 and sign > 0:
                        stats[1] += 1
                if stats[0] == 0:
                    del self.contexts[ctx]

    def prob(self, seq: list[int], start: int, tokens: list[int], vocab: int) -> list[float]:
        """P(j | the last order-1 tokens of ``seq``) for each j in ``tokens``, the n-grams of ``seq`` that
        end at positions >= ``start`` counted beside the corpus."""
        probs = [1.0 / vocab] * len(tokens)
        end = len(seq)
        for m in range(min(self.order - 1, end) + 1):
            ctx = seq[end - m :]
            key = tuple(ctx)
            own: dict[int, int] = {}
            for q in range(max(start, m), end):  # the draft's own n-grams with this context
                if m == 0 or (seq[q - 1] == ctx[-1] and seq[q - m : q] == ctx):
                    own[seq[q]] = own.get(seq[q], 0) + 1
            total, distinct = self.contexts.get(key, (0, 0))
            total += sum(own.values())
            distinct += sum(1 for t in own if key + (t,) not in self.grams)
            if total == 0:
                continue
            probs = [(self.grams.get(key + (j,), 0) + own.get(j, 0) + distinct * lower) / (total + distinct)
                     for j, lower in zip(tokens, probs)]
        return probs


@dataclass
class _Draft:
    tokens: list[int]
    logp: float  # log of the product of its tokens' interpolated probabilities
    finish: str | None = None


class SuperposedDecoder(OwnLoop):
    """Superposed Decoding: ``num_samples`` drafts from one forward per step (see the module's docstring)."""

    approximate = True
    argmax_only = True  # the output layer screened (OwnLoop.output_layer)
    expands_samples = True

    def __init__(self, target, tokenizer, options):
        super().__init__(target, tokenizer, options)
        self.k = int(options.sampling.num_samples)
        weight = options.drafting.ngram_weight
        self.ngram_weight = DEFAULT_NGRAM_WEIGHT if weight is None else float(weight)
        self.ngrams = NGramModel(options.drafting.max_ngram)
        self.embed = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
        if self.embed is None:
            raise SpecdecError("superposed decoding needs the target's input embeddings (get_input_embeddings)")

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        # the argmax exact, the other top-k probabilities from the screened layer (within its bound): this mode is approximate anyway
        with self.output_layer():
            return [self.decode(req) for req in requests]

    def _forward(self, cache, **inputs) -> torch.Tensor:
        out = self.target(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, req: GenRequest) -> GenResult:
        """The k drafts of one request, best first (the primary result and its alternatives)."""
        from transformers import DynamicCache

        prompt, max_new = list(req.prompt_ids), req.max_new_tokens
        self.ngrams.add(prompt)
        if max_new <= 0:
            return GenResult([], "length", {"new_tokens": 0, "target_calls": 0, "drafts": 1, "approximate": True}, score=0.0)
        device = self.embed.weight.device
        cache = DynamicCache(config=self.target.config)
        logits = self._forward(cache, input_ids=torch.tensor([prompt], device=device))
        calls = 1
        drafts = [_Draft([], 0.0)]
        while True:
            drafts = self._extend(drafts, logits, prompt, max_new)
            going = [d for d in drafts if d.finish is None]
            if not going:
                break
            top = max(d.logp for d in going)
            weights = [math.exp(d.logp - top) for d in going]
            total = sum(weights)
            embeds = self.embed(torch.tensor([[d.tokens[-1] for d in going]], device=device))  # (1, m, H)
            w = torch.tensor([x / total for x in weights], dtype=embeds.dtype, device=embeds.device)
            superposed = (embeds * w[None, :, None]).sum(1, keepdim=True)
            logits = self._forward(cache, inputs_embeds=superposed)
            calls += 1
        drafts.sort(key=lambda d: -d.logp)  # stable: among equal scores, the order they were kept in
        results = [GenResult(d.tokens, d.finish, {"new_tokens": len(d.tokens), "approximate": True}, score=d.logp) for d in drafts]
        best = results[0]
        best.stats.update(target_calls=calls, drafts=len(results))
        best.alternatives = results[1:]
        return best

    def _extend(self, drafts: list[_Draft], logits: torch.Tensor, prompt: list[int], max_new: int) -> list[_Draft]:
        """The next set of drafts: the finished ones as they are, and the best k - f of the candidates
        "a going draft extended by one of the step's top-k tokens"."""
        vocab = logits.shape[-1]
        probs = torch.softmax(logits.double(), -1)
        top = torch.topk(probs, min(self.k, vocab))
        p_model, tokens = top.values.tolist(), top.indices.tolist()
        w = self.ngram_weight
        done = [d for d in drafts if d.finish is not None]
        slots = self.k - len(done)
        candidates = []  # (score, parent, token)
        for parent in drafts:
            if parent.finish is not None:
                continue
            p_ngram = self.ngrams.prob(prompt + parent.tokens, len(prompt), tokens, vocab) if w > 0 else [0.0] * len(tokens)
            for j, p, q in zip(tokens, p_model, p_ngram):
                p = (1.0 - w) * p + w * q
                if p > 0:
                    candidates.append((parent.logp + math.log(p), parent, j))
        candidates.sort(key=lambda c: -c[0])  # stable: ties go to the earlier parent, then the likelier token
        kept = []
        for score, parent, j in candidates[:slots]:
            tokens_ = list(parent.tokens)
            finish = self.append(tokens_, [j], max_new)
            kept.append(_Draft(tokens_, score, finish))
        return done + kept
