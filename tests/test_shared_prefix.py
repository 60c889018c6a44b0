"""Shared prefixes: a prompt prefix every record shares is prefilled once and its keys and values are
copied to each row; decoding stays identical to prefilling every prompt whole."""

import pytest
import torch
from conftest import ByteTokenizer, make_prompts

from specdec.decode.engine import hydragen
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest


def _prompts(n, prefix_len=40, seed=5):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 96, (prefix_len,), generator=g).tolist()
    return prefix, [prefix + p for p in make_prompts(n, seed=seed, lo=2, hi=12)]


class _Counting:
    """Counts the prompt tokens the target is run on (a forward's width times its rows)."""

    def __init__(self, model):
        self.model, self.tokens = model, 0
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.tokens += int(ids.numel()) if ids is not None else 0

    def close(self):
        self._hook.remove()


@pytest.mark.parametrize("make", ["ar", "ngram", "recycle", "layerskip", "draft", "eagle"])
def test_auto_shared_prefix_decodes_as_whole_prompts_do(target, draft_model, make):
    from test_heads import _heads  # a randomly initialised head set of each kind

    from specdec.decode.drafters.heads import DRAFTERS

    prefix, prompts = _prompts(5)
    budgets = [9, 3, 14, 6, 11]
    reqs = [GenRequest(p, n) for p, n in zip(prompts, budgets)]

    def drafter():
        return {"ar": lambda: None, "ngram": NgramDrafter, "recycle": RecycleDrafter, "draft": lambda: ModelDrafter(draft_model),
                "layerskip": lambda: ModelDrafter(layer_skip_view(target, [1])),
                "eagle": lambda: DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2)}[make]()

    whole = SpecEngine(target, ByteTokenizer(), drafter()).generate(reqs)
    shared = SpecEngine(target, ByteTokenizer(), drafter(), shared_prefix="auto", min_shared=8)
    got = shared.generate(reqs[:3]) + shared.generate(reqs[3:])  # the second batch reuses the first's prefix
    assert [r.token_ids for r in got] == [r.token_ids for r in whole]
    assert shared._prefix is not None and list(shared._prefix[0]) == prefix[: len(shared._prefix[0])]
    assert len(shared._prefix[0]) >= len(prefix)


def test_the_prefix_is_run_once_per_job(target):
    prefix, prompts = _prompts(6, prefix_len=60)
    reqs = [GenRequest(p, 1) for p in prompts]
    counter = _Counting(target)
    try:
        SpecEngine(target, ByteTokenizer(), shared_prefix=None).generate(reqs)
        whole, counter.tokens = counter.tokens, 0
        engine = SpecEngine(target, ByteTokenizer(), shared_prefix="auto")
        for i in range(0, 6, 2):
            engine.generate(reqs[i : i + 2])
        shared = counter.tokens
    finally:
        counter.close()
    assert whole >= 6 * 60 and shared < whole / 3  # 60 prefix tokens once, not six times


def test_a_named_prefix_is_used_only_where_every_prompt_has_it(target):
    prefix, prompts = _prompts(3, prefix_len=20)
    reqs = [GenRequest(p, 6) for p in prompts]
    plain = SpecEngine(target, ByteTokenizer()).generate(reqs)
    named = SpecEngine(target, ByteTokenizer(), shared_prefix=prefix[:12])
    assert [r.token_ids for r in named.generate(reqs)] == [r.token_ids for r in plain] and named._prefix is not None
    other = SpecEngine(target, ByteTokenizer(), shared_prefix=[1, 2, 3])  # no prompt starts with it: plain prefill
    assert [r.token_ids for r in other.generate(reqs)] == [r.token_ids for r in plain] and other._prefix is None


def test_continuous_batching_admits_rows_onto_the_shared_prefix(target):
    prefix, prompts = _prompts(7, prefix_len=36)
    budgets = [5, 12, 3, 8, 2, 10, 4]
    reqs = [GenRequest(p, n) for p, n in zip(prompts, budgets)]
    alone = [SpecEngine(target, ByteTokenizer()).generate([r])[0].token_ids for r in reqs]
    engine = SpecEngine(target, ByteTokenizer(), NgramDrafter(), shared_prefix="auto", min_shared=8)
    got = dict(engine.stream(iter(reqs), batch_size=3))
    assert [got[i].token_ids for i in range(len(reqs))] == alone


# ---------------------------------------------------------------------------------------------
# Hydragen: the prefix held once, attention split into prefix and suffix


def _reference_attention(q, k, v, mask, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("boolean", [False, True])
def test_prefix_suffix_attention_is_attention_over_both(boolean):
    g = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, t, p, s, d = 3, 4, 2, 5, 11, 7, 8
    q = torch.randn(bsz, heads, t, d, generator=g, dtype=torch.float64)
    pk, pv = (torch.randn(1, kv_heads, p, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(bsz, kv_heads, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    seen = torch.rand(bsz, 1, t, s, generator=g) < 0.6  # holes and tree-like masks over the suffix
    seen[..., -1] = True
    mask = seen if boolean else torch.zeros(seen.shape, dtype=torch.float64).masked_fill(~seen, torch.finfo(torch.float64).min)
    full = torch.cat([torch.ones(bsz, 1, t, p, dtype=torch.bool), seen], -1)
    ref = _reference_attention(q, torch.cat([pk.expand(bsz, -1, -1, -1), k], 2), torch.cat([pv.expand(bsz, -1, -1, -1), v], 2), full, 0.3)
    torch.testing.assert_close(hydragen.prefix_suffix_attention(q, k, v, mask, pk, pv, 0.3), ref)


def test_rows_hold_only_their_suffix_and_decode_as_whole_prompts_do(target, draft_model):
    """The prefix is held once: rows' buffers hold their suffixes, every layer's attention receives
    the prefix, and rows admitted with another prefix copy theirs in (materialize) without changing
    anything decoded."""
    prefix, prompts = _prompts(4, prefix_len=48)
    other_prefix, others = _prompts(3, prefix_len=40, seed=9)
    reqs = [GenRequest(p, n) for p, n in zip(prompts + others, [7, 3, 12, 5, 9, 2, 6])]
    alone = [SpecEngine(target, ByteTokenizer()).generate([r])[0].token_ids for r in reqs]
    engine = SpecEngine(target, ByteTokenizer(), ModelDrafter(draft_model), shared_prefix="auto", min_shared=8)
    widths, calls = [], {"prefixed": 0}
    prefill = engine._prefill

    def spy(requests, index, rows, generator):
        batch, state, seg = prefill(requests, index, rows, generator)
        widths.append((state.prefix is not None, state.length, max(len(r.prompt_ids) for r in requests)))
        return batch, state, seg

    original = hydragen.prefix_suffix_attention

    def counting(*args):
        calls["prefixed"] += 1
        return original(*args)

    engine._prefill = spy
    hydragen.prefix_suffix_attention, saved = counting, hydragen.prefix_suffix_attention
    try:
        got = dict(engine.stream(iter(reqs), batch_size=2))
    finally:
        hydragen.prefix_suffix_attention = saved
    assert [got[i].token_ids for i in range(len(reqs))] == alone
    held_once = [w for w in widths if w[0]]
    assert held_once and all(length < longest - 30 for _, length, longest in held_once)
    assert calls["prefixed"] >= target.config.num_hidden_layers


def test_models_hydragen_cannot_serve_keep_the_copied_prefix():
    from test_architectures import EOS, build

    model = build("mistral")  # sliding windows: the prefix would need a per-query window
    prefix = list(range(5, 45))
    reqs = [GenRequest(prefix + [50 + i, 60 + i], 8) for i in range(3)]
    whole = SpecEngine(model, ByteTokenizer(), eos_ids=[EOS]).generate(reqs)
    shared = SpecEngine(model, ByteTokenizer(), eos_ids=[EOS], shared_prefix="auto", min_shared=8)
    assert [r.token_ids for r in shared.generate(reqs)] == [r.token_ids for r in whole]
    assert shared._prefix is not None and not shared._hydragen()
    assert not model.config._attn_implementation.startswith(hydragen.PREFIX)


def test_an_attention_asking_for_more_than_softmax_is_refused_not_approximated():
    """Attention sinks, soft-capping or a position bias handed to the attention function at run time
    cannot be split into prefix and suffix parts as implemented: one clear error, not a wrong output."""
    from conftest import tiny_llama
    from transformers import AttentionInterface

    from specdec.models.errors import SpecdecError

    model = tiny_llama(seed=7)
    assert hydragen.enable(model)
    attention = AttentionInterface._global_mapping[model.config._attn_implementation]
    q, kv = torch.zeros(2, 4, 3, 12, dtype=torch.float64), torch.zeros(2, 2, 3, 12, dtype=torch.float64)
    prefix = [(torch.zeros(1, 2, 5, 12, dtype=torch.float64),) * 2 for _ in range(3)]
    layer = model.model.layers[0].self_attn
    assert attention(layer, q, kv, kv, None, shared_prefix=prefix, sliding_window=None, scaling=0.3)[0].shape == (2, 3, 4, 12)
    with pytest.raises(SpecdecError, match="s_aux"):
        attention(layer, q, kv, kv, None, shared_prefix=prefix, s_aux=torch.zeros(4))


def test_a_target_on_specdecs_tree_attention_holds_the_prefix_once():
    """CUDA decodes run the target on specdec's tree attention (SDPA with a Triton kernel for verify
    forwards); Hydragen serves it as it serves SDPA (here its SDPA path: no kernel on a CPU)."""
    pytest.importorskip("triton")
    from conftest import tiny_llama

    from specdec.kernels.tree_attention import register

    model = tiny_llama(seed=0)
    prefix, prompts = _prompts(4)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [9, 3, 14, 6])]
    whole = SpecEngine(model, ByteTokenizer(), NgramDrafter()).generate(reqs)
    model.set_attn_implementation(register())
    shared = SpecEngine(model, ByteTokenizer(), NgramDrafter(), shared_prefix="auto", min_shared=8)
    assert [r.token_ids for r in shared.generate(reqs)] == [r.token_ids for r in whole]
    assert shared._hydragen() and shared._prefix is not None
