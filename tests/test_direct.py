"""A target's decoder layers in one C++ call (``decode.engine.direct``, ``kernels/step.cpp``): used only where
its logits are transformers' floats bit for bit, so decoding through it is the same text, token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import ByteTokenizer
from gguf_files import random_blocks
from test_architectures import EOS, NEW, PROMPTS, build

from specdec.decode.drafters.base import NoDrafter
from specdec.decode.drafters.model_free import NgramDrafter
from specdec.decode.engine import cache as cache_mod
from specdec.decode.engine import direct
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.kernels import qmatmul as kernel
from specdec.models import blocks, norms

pytestmark = pytest.mark.skipif(not blocks.kernel_ready(), reason="the C++ operators need AVX2 and a compiler")


def _gemma(seed: int = 0, quantised: bool = False):
    """A tiny float32 Gemma 3 (sliding window 8, so long rows take the per-layer-type masks) with its norms
    routed as a target's are; ``quantised``: its linear layers multiply by Q8_0 blocks (models.blocks' route)."""
    model = build("gemma3", seed=seed).float()
    with torch.no_grad():  # norms away from their zero init, as a trained model's are
        for m in model.modules():
            if type(m).__name__ == "Gemma3RMSNorm":
                m.weight.normal_(0, 0.5)
    norms.install(model)
    if quantised:
        state = blocks.BlockLayers()
        for i, layer in enumerate(model.model.layers):
            for name in direct.LINEARS:
                lin = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
                raw = torch.from_numpy(random_blocks("Q8_0", lin.out_features, lin.in_features, seed=100 + i, scale=0.2))
                with torch.no_grad():
                    lin.weight.copy_(kernel.qdequant(raw, kernel.BLOCKS["Q8_0"][0], lin.in_features))
                blocks._route(lin, raw, kernel.BLOCKS["Q8_0"][0], state)
        state.enabled = True
        model._specdec_blocks = state
    return model


def _decode(model, drafter, prompts, use_direct: bool, monkeypatch):
    monkeypatch.setattr(cache_mod, "direct_step", direct.direct_step if use_direct else (lambda m, b: None))
    engine = SpecEngine(model, ByteTokenizer(), drafter, eos_ids=[EOS])
    return [r.token_ids for r in engine.generate([GenRequest(p, NEW) for p in prompts])]


@pytest.fixture()
def calls(monkeypatch):
    """How many forwards ran through the direct step."""
    seen = []
    real = direct.DirectStep.__call__
    monkeypatch.setattr(direct.DirectStep, "__call__", lambda self, *a: seen.append(a[0].shape) or real(self, *a))
    return seen


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("drafter", [NoDrafter, NgramDrafter])
@pytest.mark.parametrize("bsz", [1, 3])
def test_decoding_through_the_direct_step_is_the_same_text(monkeypatch, calls, quantised, drafter, bsz):
    model = _gemma(quantised=quantised)
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None
    # a target on quantised blocks attends with the step's own attention, in both forwards; a float one keeps SDPA
    assert model.config._attn_implementation == (direct.OWN_ATTENTION if quantised else "sdpa")
    calls.clear()  # the probe's own
    prompts = PROMPTS[:bsz]
    want = _decode(model, drafter(), prompts, False, monkeypatch)
    assert not calls
    hf = []
    real = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: hf.append(k["input_ids"].shape) or real(self, *a, **k))
    got = _decode(model, drafter(), prompts, True, monkeypatch)
    assert got == want
    assert calls and all(shape.numel() <= direct.MAX_ROWS for shape in calls)
    if bsz == 1:  # one row: every forward after the prompt's went through the direct step
        assert len(hf) == 1
    if drafter is NgramDrafter:
        assert any(shape[1] > 1 for shape in calls)  # verification forwards of several positions too


def test_one_row_decodes_generates_text():
    model = _gemma(seed=1)
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None
    engine = SpecEngine(model, ByteTokenizer(), NoDrafter(), eos_ids=[EOS])
    for p in PROMPTS:
        want = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW,
                              do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p):].tolist()
        assert engine.generate([GenRequest(p, NEW)])[0].token_ids == want


def test_a_step_that_rounds_differently_is_not_used(monkeypatch):
    """The probe decides: the same layers with the attention's scale one part in a million off give other
    floats, and transformers' forward stays."""
    real = direct._layers
    monkeypatch.setattr(direct, "_layers", lambda *a: real(*a[:15], a[15] * (1 + 2**-20), *a[16:]))
    assert direct.direct_step(_gemma(seed=2), cache_mod.SlotBuffers) is None
    monkeypatch.setattr(direct, "_layers", real)
    assert direct.direct_step(_gemma(seed=2), cache_mod.SlotBuffers) is not None


@pytest.mark.parametrize("name", ["llama", "llama-gqa", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_the_llama_family_decodes_the_same_text_through_it(monkeypatch, calls, name, bsz):
    """Llama's RMSNorm and SiLU MLP, grouped keys, biases (Qwen2), sliding windows (Mistral, Qwen2), query and key
    norms before the heads' transpose (Qwen3): the same text with and without the step."""
    model = build(name).float()
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None
    calls.clear()
    prompts = PROMPTS[:bsz]
    want = _decode(model, NgramDrafter(), prompts, False, monkeypatch)
    assert _decode(model, NgramDrafter(), prompts, True, monkeypatch) == want and calls


def test_models_it_does_not_describe_keep_transformers_forward():
    plain = build("gemma3").float()  # norms not routed: their arithmetic is transformers' own
    assert direct.direct_step(plain, cache_mod.SlotBuffers) is None
    for name in ("gpt2", "phi3", "gemma2"):
        assert direct.direct_step(build(name).float(), cache_mod.SlotBuffers) is None
    eager = build("llama", attn="eager").float()  # transformers' eager attention: not the SDPA call the step makes
    assert direct.direct_step(eager, cache_mod.SlotBuffers) is None



def test_a_hook_on_a_layer_sends_the_forward_to_transformers(calls):
    """A riding drafter hooks the target's modules for one forward: that forward must run them."""
    model = _gemma(seed=3)
    step = direct.direct_step(model, cache_mod.SlotBuffers)
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    engine = SpecEngine(model, ByteTokenizer(), NoDrafter(), eos_ids=[EOS])
    calls.clear()
    engine.generate([GenRequest(PROMPTS[0], 4)])
    assert not calls and len(seen) >= 4
    handle.remove()
    handle = model.register_forward_pre_hook(lambda *a: seen.append(2))  # on the model itself (a test's slow target)
    engine.generate([GenRequest(PROMPTS[0], 4)])
    assert not calls and seen.count(2) >= 4
    handle.remove()
    engine.generate([GenRequest(PROMPTS[0], 4)])
    assert calls and step is direct.direct_step(model, cache_mod.SlotBuffers)


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_the_rotary_tables_are_the_modules_own_rows(name):
    """The step reads cos and sin from a table of the rotary module's output (grown when a position passes it):
    at any positions, the module's own floats."""
    model = _gemma(seed=8) if name == "gemma3" else build(name).float()
    step = direct.direct_step(model, cache_mod.SlotBuffers)
    x = torch.zeros(1, 1, model.config.hidden_size)
    with torch.no_grad():
        for positions in (torch.arange(8)[None], torch.tensor([[5000, 17, 4999]]), torch.tensor([[3]]),
                          torch.tensor([[direct.ROPE_TABLE_MAX + 5]])):  # past the longest table: the module's call
            got, want = step._rope(x, positions), step._rotary(x, positions)
            assert all(torch.equal(g, w) for pair, ref in zip(got, want) for g, w in zip(pair, ref))
    assert 5000 < step._rope_table[0] <= direct.ROPE_TABLE_MAX


def test_a_rotary_module_whose_rows_depend_on_each_other_is_called_every_forward(monkeypatch):
    """Where a position's cos and sin would change with the positions computed beside it, the table's rows are not
    the module's calls: the step finds so and calls the module each forward."""
    model = build("llama").float()
    step = direct.direct_step(model, cache_mod.SlotBuffers)
    rotary = model.model.rotary_emb
    real = type(rotary).forward
    monkeypatch.setattr(type(rotary), "forward", lambda self, x, p: tuple(t + p.float().mean() for t in real(self, x, p)))
    step._rope_table = None  # the probe that built the step has built a table of the real module
    x = torch.zeros(1, 1, model.config.hidden_size)
    positions = torch.arange(4, 7)[None]
    with torch.no_grad():
        got, want = step._rope(x, positions), step._rotary(x, positions)
    assert step._rope_table is False
    assert all(torch.equal(g, w) for pair, ref in zip(got, want) for g, w in zip(pair, ref))


def _step_logits(model, step, ids):
    """The step's logits of the last 3 of ``ids`` after transformers' prefill of the rest, over the engine's buffers."""
    cache = cache_mod.SlotBuffers(model.config.num_hidden_layers, 16, torch.device("cpu"), zeroed=False)
    n = ids.shape[1] - 3
    with torch.no_grad():
        cache.at(0, False)
        model(input_ids=ids[:, :n], position_ids=torch.arange(n)[None], past_key_values=cache, use_cache=True)
        cache.at(n, False)
        return step(ids[:, n:], None, torch.arange(n, n + 3)[None], cache).logits


def _own_attention_setup(cached: int, t: int, n_caches: int, monkeypatch):
    """A target on quantised blocks under the step's own attention, the masks its step builds (recorded per forward),
    ``cached + t`` prompt tokens, and ``n_caches`` caches each holding transformers' prefill of the first ``cached``."""
    model = _gemma(seed=9, quantised=True)
    step = direct.direct_step(model, cache_mod.SlotBuffers)
    assert step is not None and model.config._attn_implementation == direct.OWN_ATTENTION
    built = []
    real = step._masks
    monkeypatch.setattr(step, "_masks", lambda *a: built.append(r := real(*a)) or r)
    ids = torch.tensor([[x for p in PROMPTS for x in p][:cached + t]])
    caches = [cache_mod.SlotBuffers(model.config.num_hidden_layers, 16, torch.device("cpu"), zeroed=False) for _ in range(n_caches)]
    with torch.no_grad():
        for c in caches:
            c.at(0, False)
            model(input_ids=ids[:, :cached], position_ids=torch.arange(cached)[None], past_key_values=c, use_cache=True)
            c.at(cached, False)
    return model, step, built, ids, caches


@pytest.mark.parametrize("cached", [6, 7, 8, 9])
def test_one_position_under_the_own_attention_takes_no_mask_while_it_sees_every_key(cached, monkeypatch):
    """A one-position step of a target on quantised blocks, given no mask, attends without one while its keys lie
    within the sliding window (8 here), and builds transformers' masks past it: its logits are transformers'
    forward's either way."""
    model, step, built, ids, caches = _own_attention_setup(cached, 1, 2, monkeypatch)
    with torch.no_grad():
        pos = torch.tensor([[cached]])
        want = model(input_ids=ids[:, cached:], position_ids=pos, past_key_values=caches[0], use_cache=True).logits
        got = step(ids[:, cached:], None, pos, caches[1]).logits
    assert torch.equal(got, want)
    assert all(m is None for m in built[0]) == (cached + 1 <= 8)


@pytest.mark.parametrize("cached, t", [(2, 2), (4, 3), (5, 3), (6, 3), (7, 2)])
def test_a_few_positions_under_the_own_attention_take_the_causal_mask_built_by_the_step(cached, t, monkeypatch):
    """Several positions of a target on quantised blocks, given no mask: while their keys lie within the sliding
    window (8 here) the step builds the causal mask itself, held equal to transformers' masks of both layer types
    at its first such forward (which takes theirs); past the window it builds theirs. The logits are transformers'
    forward's every time."""
    model, step, built, ids, caches = _own_attention_setup(cached, t, 3, monkeypatch)
    with torch.no_grad():
        pos = torch.arange(cached, cached + t)[None]
        want = model(input_ids=ids[:, cached:], position_ids=pos, past_key_values=caches[0], use_cache=True).logits
        got = [step(ids[:, cached:], None, pos, c).logits for c in caches[1:]]
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    visible = torch.arange(cached + t)[None, :] <= pos[0, :, None]  # key slot j seen by the query at position p iff j <= p
    if cached + t <= 8:
        assert step._own_causal is True
        assert all(torch.equal(m[0, 0], visible) for forward in built for m in forward)
        assert built[1][0] is built[1][1]  # the second forward's, the step's own: one tensor for both layer types
    else:
        assert step._own_causal is None  # never compared: transformers' masks, the sliding layers' hiding the first key
        assert not all(torch.equal(m[0, 0], visible) for m in built[1])


def test_with_avx512_a_positions_hidden_states_do_not_depend_on_the_forwards_width():
    """With AVX-512, a target on quantised blocks computes each position of a forward of up to 16 (a verification)
    with the floats it gets alone (plain decoding's step): the blocks' products keep two accumulators a position at
    every width, the step's attention takes the rows itself, the norms and the rest work row by row. Bit for bit,
    every layer's output, past the sliding window (8) too."""
    if not kernel.isa512():
        pytest.skip("the AVX2 kernels' accumulators follow the width")
    model = _gemma(seed=10, quantised=True)
    step = direct.direct_step(model, cache_mod.SlotBuffers)
    ids = torch.tensor([[t for p in PROMPTS for t in p][:13]])
    caches = [cache_mod.SlotBuffers(model.config.num_hidden_layers, 16, torch.device("cpu"), zeroed=False) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            c.at(0, False)
            model(input_ids=ids[:, :5], position_ids=torch.arange(5)[None], past_key_values=c, use_cache=True)
            c.at(5, False)
        wide = step(ids[:, 5:], None, torch.arange(5, 13)[None], caches[0], True).hidden_states
        for i in range(5, 13):
            caches[1].at(i, False)
            alone = step(ids[:, i:i + 1], None, torch.tensor([[i]]), caches[1], True).hidden_states
            assert all(torch.equal(w[:, i - 5:i - 4], a) for w, a in zip(wide, alone)), i


def _write_norm(model):
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(1.5)


def _replace_norm(model):
    """A new parameter in a norm's place, its version number the old one's (as a state dict assigned may give)."""
    norm = model.model.layers[1].post_feedforward_layernorm
    old, new = norm.weight, torch.nn.Parameter(norm.weight.detach() * 0.5)
    with torch.no_grad():
        while new._version < old._version:
            new.mul_(1.0)
    norm.weight = new


@pytest.mark.parametrize("change", [_write_norm, _replace_norm])
def test_a_norm_weight_written_or_replaced_after_the_step_was_built_is_the_one_it_reads(change):
    """The step keeps the norms' slots between forwards, and the routed norms their 1 + w: a weight written in place,
    or a new parameter put in its place, must reach the next forward, as it does in a model given that weight
    before its first forward."""
    ids = torch.tensor([PROMPTS[0][:9]])
    used = _gemma(seed=7)
    step = direct.direct_step(used, cache_mod.SlotBuffers)
    before = _step_logits(used, step, ids)
    change(used)
    fresh = _gemma(seed=7)
    change(fresh)
    want = _step_logits(fresh, direct.direct_step(fresh, cache_mod.SlotBuffers), ids)
    assert not torch.equal(before, want)
    assert torch.equal(_step_logits(used, step, ids), want)


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("bsz", [1, 3])
def test_a_drafter_that_reads_hidden_states_decodes_through_the_direct_step(monkeypatch, calls, quantised, bsz):
    """A drafter reading the target's hidden states (a block drafter on EAGLE-3's fused layers) gets them from the
    direct step too: its verify forwards run there, the drafts are the same and so is the text (greedy, as
    plain decoding gives it)."""
    from specdec.decode.drafters.heads import BlockDrafter
    from specdec.models.head_artifacts import build_heads

    model = _gemma(seed=1, quantised=quantised)
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None
    calls.clear()
    torch.manual_seed(0)
    heads = build_heads("block", model, {"num_heads": 3}).attach(model).float().eval()
    with torch.no_grad():
        heads.block_position.normal_(0, 0.5)
    # EAGLE-3's layers (on this 3-layer target two of them): intermediate layers' outputs, not only the last
    assert heads.feature_layers and max(heads.feature_layers) < model.config.num_hidden_layers
    prompts = PROMPTS[:bsz]
    drafts = {}

    class Spy(BlockDrafter):
        def _reset_tree(self, batch):
            super()._reset_tree(batch)
            drafts.setdefault(self.tag, []).append(self._logp.argmax(-1))

    def run(use_direct):
        drafter = Spy(heads, model, tree="static", tree_tokens=3, top_k=1)
        drafter.tag = use_direct
        return _decode(model, drafter, prompts, use_direct, monkeypatch)

    want = run(False)
    assert not calls
    got = run(True)
    plain = _decode(model, NoDrafter(), prompts, False, monkeypatch)
    assert got == want == plain
    assert any(shape[1] > 1 for shape in calls)  # the verify forwards, with their hidden states
    assert len(drafts[True]) == len(drafts[False]) and all(torch.equal(a, b) for a, b in zip(drafts[True], drafts[False]))


@pytest.fixture(params=["fastest", "avx2"])
def isa(request):
    """The kernels' instruction set: the fastest this CPU has, then AVX2 alone (a machine with AVX-512 tests both)."""
    before = kernel.set_isa(0 if request.param == "fastest" else 1)
    yield request.param
    kernel.set_isa(before)


def _attention_reference(q, k, v, mask, groups, scaling):
    """softmax(q k^T * scaling + mask) v in float64, each query head on its key/value head, [B, T, heads, D];
    a row whose keys are all masked gives zeros."""
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    out = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    return out.transpose(1, 2)


@pytest.mark.parametrize("batch, kv_heads, groups, t, keys, dim", [
    (1, 1, 4, 1, 257, 256),  # Gemma 3 270M's one position over a few hundred keys (five key chunks, the last of one key)
    (1, 1, 4, 4, 300, 256),  # a verify forward: 16 query rows, two row blocks
    (2, 2, 2, 3, 37, 64),
    (3, 1, 4, 1, 9, 32),
    (1, 4, 1, 5, 20, 16),
    (1, 1, 2, 8, 130, 32),  # 16 query rows: the most the 8-lane build takes itself
    (1, 1, 4, 8, 264, 256),  # Gemma 3 270M verifying 8 positions: 32 rows, the 16-lane build's, SDPA's with AVX2
    (1, 1, 4, 16, 130, 32),  # 64 query rows: the most the 16-lane build takes itself
    (1, 1, 4, 17, 130, 32),  # 68: handed to SDPA
])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool"])
def test_the_steps_own_attention_is_softmax_attention(batch, kv_heads, groups, t, keys, dim, mask_kind, isa):
    """The step's attention of a few positions (kernels/step.cpp, both instruction sets' builds): split-key softmax
    attention over keys and values read in place (slices of larger buffers), with additive or boolean masks
    broadcast over heads, holes, and a row with every key masked, within float32 rounding of the float64 reference."""
    if mask_kind == "none" and t > 1:
        pytest.skip("several positions without a mask are SDPA's causal case, which the operator hands to SDPA")
    gen = torch.Generator().manual_seed(t * 100 + keys)
    q = torch.randn(batch, kv_heads * groups, t, dim, generator=gen)
    k = torch.randn(batch, kv_heads, keys + 7, dim, generator=gen)[:, :, 3:keys + 3]
    v = torch.randn(batch, kv_heads, keys + 7, dim, generator=gen)[:, :, 3:keys + 3]
    visible = torch.rand(batch, 1, t, keys, generator=gen) > 0.3
    visible[..., -1] = True
    if batch > 1:
        visible[1, 0, 0] = False  # one row sees no key at all
    mask = {"none": None, "bool": visible,
            "additive": torch.zeros(batch, 1, t, keys).masked_fill(~visible, float("-inf"))}[mask_kind]
    with torch.no_grad():
        got = torch.ops.specdec_q.attention(q, k, v, mask, groups, dim ** -0.5, True)
    want = _attention_reference(q, k, v, mask, groups, dim ** -0.5)
    assert got.shape == (batch, t, kv_heads * groups, dim)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    if batch > 1 and mask is not None:
        assert torch.all(got[1, 0, :groups] == 0)  # the row without keys (its key/value head 0's query heads)


@pytest.mark.parametrize("dim", [256, 32])
def test_a_positions_attention_is_the_same_floats_whatever_the_width(dim, isa):
    """A verification's positions attend as they would one at a time: a row's floats depend neither on how many
    positions share the call nor on its place among them, up to the most query rows the CPU's build takes itself
    (16 with AVX2, 64 with AVX-512: 16 Gemma 3 270M positions), so a verification attends as plain decoding does,
    bit for bit. Where a width goes to SDPA instead, its floats are SDPA's (which this test would catch drifting
    into the own build's range)."""
    gen = torch.Generator().manual_seed(dim)
    groups, keys = 4, 200
    most = 16 if (kernel.isa512() and isa == "fastest") else 4
    k = torch.randn(1, 1, keys, dim, generator=gen)
    v = torch.randn(1, 1, keys, dim, generator=gen)
    q = torch.randn(1, groups, most, dim, generator=gen)
    start = keys - most  # position i sees keys [0, start + i]
    visible = torch.ones(most, keys, dtype=torch.bool).tril_(start)
    mask = torch.zeros(1, 1, most, keys).masked_fill(~visible, float("-inf"))
    op = torch.ops.specdec_q.attention
    with torch.no_grad():
        alone = torch.cat([op(q[:, :, i:i + 1], k[:, :, :start + i + 1], v[:, :, :start + i + 1], None, groups, dim ** -0.5, True)
                           for i in range(most)], 1)
        for width in sorted({1, 2, most // 2, most}):
            for s0 in range(0, most, width):
                got = op(q[:, :, s0:s0 + width], k, v, mask[:, :, s0:s0 + width], groups, dim ** -0.5, True)
                assert torch.equal(got, alone[:, s0:s0 + width]), (width, s0)


def test_the_steps_own_attention_is_what_both_forwards_of_a_quantised_target_run(monkeypatch):
    """Both the decode step and transformers' forward of a target on quantised blocks call the step's attention;
    where transformers' side would not compute it as the step does, the probe finds the floats differ and both
    forwards keep SDPA."""
    model = _gemma(seed=4, quantised=True)
    seen = []
    real, register = direct.step_attention, direct.register_attention
    monkeypatch.setattr(direct, "register_attention", lambda: register(lambda *a, **k: seen.append(1) or real(*a, **k)))
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None and seen
    skewed = _gemma(seed=5, quantised=True)  # transformers' forward on SDPA while the step attends its own way
    monkeypatch.setattr(direct, "register_attention", lambda: register(_plain_sdpa))
    assert direct.direct_step(skewed, cache_mod.SlotBuffers) is not None
    assert skewed.config._attn_implementation == "sdpa"


def test_outside_the_engine_a_quantised_target_attends_with_transformers_sdpa(monkeypatch):
    """The step's attention is the blocks' companion: outside the engine (the blocks off, as a user's or a
    benchmark peer's transformers forward runs the model) a decode step's logits are SDPA's to the last float,
    and the step's operator is not called; inside, it is."""
    from transformers import DynamicCache

    from specdec.models import head

    model = _gemma(seed=6, quantised=True)
    model._specdec_blocks.enabled = False  # as a target's blocks are outside the engine (models.blocks.install)
    assert direct.direct_step(model, cache_mod.SlotBuffers) is not None
    assert model.config._attn_implementation == direct.OWN_ATTENTION
    seen = []
    real = torch.ops.specdec_q.attention
    monkeypatch.setattr(torch.ops.specdec_q, "attention", lambda *a: seen.append(1) or real(*a))
    ids = torch.tensor([PROMPTS[0][:6]])

    def step_logits():
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True)
            return model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits

    outside = step_logits()
    assert not seen
    with head.scope(model, greedy=False):
        step_logits()
    assert seen
    model.set_attn_implementation("sdpa")
    assert torch.equal(outside, step_logits())


def _plain_sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)
