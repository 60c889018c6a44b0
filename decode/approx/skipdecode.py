"""SkipDecode (Del Corro et al. 2023, ``--drafter skipdecode[:FIRST,LAST]``): later positions of a batch
bypass more of the target's lower layers (approximate: the output is an early-exit model's, not the
target's).

The prompt runs all L layers and gives the first new token. Generation step t (0-based: the forward that
is fed new token t and gives token t + 1) runs only the top n_t layers: the token's input embedding goes
straight into layer L - n_t, then the final norm and the LM head. n_t falls linearly from FIRST at step 0
to LAST at the budget's last step (step ``max_new_tokens - 2``), rounded half up, so it never grows:

    n_t = FIRST - round((FIRST - LAST) * t / (max_new_tokens - 2))

Because n_t never grows, every layer a token runs was run by every earlier token: its keys and values
are there, nothing is recomputed. The layers below L - n_t are never read again, so their cache entries
are dropped as n_t shrinks (the project's ``KVState``: the buffers keep every slot of sliding-window
layers too, the window lives in the masks, so positions and masks are those of the full model's rows).
A step runs a weight-sharing view of the target without its bottom L - n_t layers
(``models.views.layer_skip_view``).

The schedule is batch-level, as in the paper: ``generate`` decodes the requests that share a budget as one
left-padded static batch (every row is at the same step at once), each such batch on the schedule of its
budget; a finished row leaves the batch. Defaults: FIRST = L, LAST = ceil(L / 2).
"""

from __future__ import annotations

import math
import time

import torch

from specdec.decode.engine.cache import KVState
from specdec.decode.engine.own import OwnLoop
from specdec.decode.engine.types import GenRequest, GenResult
from specdec.models.errors import UsageError

USAGE = "skipdecode:FIRST,LAST names the layers the first and the last generation step run (integers, FIRST >= LAST >= 1)"


def check_spec(spec: str) -> tuple[int, int] | None:
    """(FIRST, LAST) of ``skipdecode:FIRST,LAST``, or None for bare ``skipdecode`` (the defaults, known
    once the target is); a ``UsageError`` for what is malformed without knowing the target. That
    FIRST is at most the target's layer count is checked at build."""
    _, colon, arg = spec.partition(":")
    if not colon:
        return None
    parts = [p.strip() for p in arg.split(",")]
    if len(parts) != 2:
        raise UsageError(f"{spec!r}: {USAGE}")
    try:
        first, last = int(parts[0]), int(parts[1])
    except ValueError:
        raise UsageError(f"{spec!r}: {USAGE}") from None
    if last < 1:
        raise UsageError(f"{spec!r}: the last step must run at least one layer (LAST >= 1), got {last}")
    if first < last:
        raise UsageError(f"{spec!r}: the layer count never grows along the output (FIRST >= LAST), got {first} < {last}")
    return first, last


def build(spec: str, target, tokenizer, options) -> "SkipDecoder":
    """The registry's factory for ``skipdecode[:FIRST,LAST]``."""
    first, last = check_spec(spec) or (None, None)
    return SkipDecoder(target, tokenizer, options, first, last, spec=spec)


def schedule(first: int, last: int, budget: int) -> list[int]:
    """n_t, the layers generation step t runs, for t = 0 .. budget - 2 (a budget of N new tokens takes
    N - 1 generation steps after the prompt's forward): linear from ``first`` to ``last``, rounded half
    up in integers (non-increasing)."""
    steps = budget - 1
    if steps <= 0:
        return []
    if steps == 1:
        return [first]
    drop, span = first - last, steps - 1
    return [first - (2 * drop * t + span) // (2 * span) for t in range(steps)]


class SkipDecoder(OwnLoop):
    """SkipDecode over ``target``: ``first`` and ``last`` layers at the first and last generation steps
    (None: L and ceil(L / 2)); greedy."""

    approximate = True
    argmax_only = True  # the output layer screened (OwnLoop.output_layer)

    def __init__(self, target, tokenizer, options, first: int | None = None, last: int | None = None, spec: str = "skipdecode"):
        super().__init__(target, tokenizer, options)
        from specdec.models import arch
        from specdec.models.loading import input_device

        self.num_layers = layers = len(arch.decoder_layers(target)[2])
        self.first = layers if first is None else first
        self.last = math.ceil(layers / 2) if last is None else last
        if self.first > layers:
            raise UsageError(f"{spec!r}: the target has {layers} decoder layers; FIRST must be at most {layers}, got {self.first}")
        if not 1 <= self.last <= self.first:
            raise UsageError(f"{spec!r}: the layer counts must satisfy {layers} >= FIRST >= LAST >= 1, got FIRST {self.first}, LAST {self.last}")
        self.device = input_device(target)
        self._views: dict[int, torch.nn.Module] = {}

    def view(self, n: int):
        """The target running only its top ``n`` decoder layers (weights shared; the target itself for all L)."""
        if n == self.num_layers:
            return self.target
        if n not in self._views:
            from specdec.models.views import layer_skip_view

            self._views[n] = layer_skip_view(self.target, list(range(self.num_layers - n)))
        return self._views[n]

    def schedule(self, budget: int) -> list[int]:
        return schedule(self.first, self.last, budget)

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        results: list[GenResult | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(requests):  # the schedule is batch-level: one static batch per budget
            groups.setdefault(req.max_new_tokens, []).append(i)
        with self.output_layer():  # each step's argmax only
            for budget, index in groups.items():
                for i, result in zip(index, self._decode([requests[i] for i in index], budget)):
                    results[i] = result
        return results

    @torch.no_grad()
    def _decode(self, requests: list[GenRequest], budget: int) -> list[GenResult]:
        """One static batch of requests of one budget, on that budget's schedule."""
        start = time.perf_counter()
        n_rows = len(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        finish: list[str | None] = [None] * n_rows
        layers_run = [0] * n_rows  # per row: the layers of the forwards that gave its tokens, summed
        calls = [0] * n_rows  # per row: the forwards it took part in, the prompt's included
        walls = [0.0] * n_rows
        if budget <= 0:
            return [self._result([], "length", 0, 0, 0.0) for _ in requests]
        state = KVState(self.target, n_rows, self.device)
        # the prompt: all L layers, the rows left-padded (holes) to one width
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.zeros(n_rows, width, dtype=torch.long)
        valid = torch.zeros(n_rows, width, dtype=torch.bool)
        for r, req in enumerate(requests):
            ids[r, width - len(req.prompt_ids) :] = torch.tensor(req.prompt_ids, dtype=torch.long)
            valid[r, width - len(req.prompt_ids) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        out = state.forward(ids, None if bool(valid.all()) else valid, logits_to_keep=1)
        state.commit_prefix(width, valid)
        ran = depth = self.num_layers  # layers of the last forward; layers the cache still holds (the top ones)
        live = list(range(n_rows))
        steps = self.schedule(budget)
        for step in range(len(steps) + 1):
            best = out.logits[:, -1].argmax(-1).tolist()
            now = time.perf_counter() - start
            for r, tok in zip(live, best):
                calls[r] += 1
                layers_run[r] += ran
                finish[r] = self.append(tokens[r], [tok], budget)
                if finish[r]:
                    walls[r] = now
            keep = [j for j, r in enumerate(live) if not finish[r]]
            if not keep:
                break
            if len(keep) < len(live):  # finished rows leave the batch (and its cache)
                state.select_rows(torch.tensor(keep, device=self.device))
                live, best = [live[j] for j in keep], [best[j] for j in keep]
            ran = steps[step]  # a row that has not finished has budget left: there is a step
            if ran < depth:  # the lowest layers are bypassed from now on: their keys and values go
                del state.cache.layers[: depth - ran]
                depth = ran
            state.model = self.view(ran)
            token = torch.tensor(best, dtype=torch.long, device=self.device)[:, None]
            out = state.forward(token)
            state.commit_prefix(1, torch.ones_like(token, dtype=torch.bool))
        return [self._result(tokens[r], finish[r], calls[r], layers_run[r], walls[r]) for r in range(n_rows)]

    @staticmethod
    def _result(tokens: list[int], finish: str | None, calls: int, layers_run: int, wall: float) -> GenResult:
        stats = {
            "new_tokens": len(tokens),
            "target_calls": calls,
            "layers_run": round(layers_run / len(tokens), 6) if tokens else 0.0,  # mean per generated token
            "approximate": True,
            "row_wall_s": round(wall, 6),
        }
        return GenResult(token_ids=tokens, finish_reason=finish or "length", stats=stats)
