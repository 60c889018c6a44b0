"""LongSpec: a draft with a constant-size KV cache (sink tokens + a sliding window) trained at anchor-offset
positions (train.trainers.draft ``long_context``, decode.drafters.long_draft)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import invoke, save_tiny_lm, tiny_llama, tiny_tokenizer
from test_s2d import tiny_cfg, write_data

WINDOW, SINKS, K = 16, 4, 3


@pytest.fixture(scope="module")
def long(tmp_path_factory):
    """A target of 1024 positions and a 1-layer draft trained with --long-context (window 16, 4 sinks), the
    position ids and masks its forwards were given."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from specdec.train.trainers.draft import train_draft

    root = tmp_path_factory.mktemp("long")
    tok = tiny_tokenizer()
    save_tiny_lm(root / "target", tok, seed=0, layers=2, hidden=48, max_pos=1024)
    write_data(root / "data.jsonl")
    seen = []
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        if kwargs.get("position_ids") is not None and self.config.num_hidden_layers == 1:
            seen.append((kwargs["position_ids"].detach().cpu(), kwargs.get("attention_mask")))
        return forward(self, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(LlamaForCausalLM, "forward", spy)
    try:
        metrics = train_draft(root / "target", [root / "data.jsonl"], root / "draft", tiny_cfg(steps=10, seq_len=32),
                              arch="layers=1,hidden=32,heads=4", kd_weight=1.0, long_context=True, window=WINDOW, sinks=SINKS)
    finally:
        mp.undo()
    return root, metrics, seen


def test_training_uses_anchor_offset_positions_and_the_loss_falls(long):
    root, m, seen = long
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3, curve
    assert len(seen) >= 10
    for pos, mask in seen:
        assert pos.shape[1] == 32
        assert (pos[:, :SINKS] == torch.arange(SINKS)).all()  # the sinks keep their positions
        assert (pos[:, SINKS:] >= 32).all()  # the rest sit beyond the block's own length (0..31)...
        assert (pos[:, SINKS:].diff(dim=1) == 1).all() and (pos < 1024).all()  # ...contiguous, within the model's
        assert mask is not None and mask.shape[-2:] == (32, 32)  # the sinks + window mask (32 > 4 + 16 + 1)
    assert len({int(p[0, SINKS]) for p, _ in seen}) > 1 and max(int(p.max()) for p, _ in seen) > 100  # anchors are drawn
    cfg = json.loads((root / "draft" / "config.json").read_text())
    assert cfg["specdec_long"]["window"] == WINDOW and cfg["specdec_long"]["sinks"] == SINKS


def test_anchor_positions_and_mask():
    from specdec.train.trainers.draft import anchor_positions, sink_window_visible

    g = torch.Generator().manual_seed(0)
    pos = anchor_positions(64, 32, 4, 1024, g)
    assert (pos[:, :4] == torch.arange(4)).all() and (pos[:, 4] >= 32).all() and 512 < int(pos.max()) <= 1023
    assert (pos[:, 4:].diff(dim=1) == 1).all()
    assert (anchor_positions(2, 32, 4, 40, g) == torch.arange(32)).all()  # no room beyond the block: plain positions
    vis = sink_window_visible(10, 2, 3)
    assert vis[9].tolist() == [True, True, False, False, False, False, True, True, True, True]
    assert not vis.triu(1).any()


def test_evicted_cache_gives_the_logits_of_the_kept_tokens():
    """A 1-layer draft's keys depend on the token and its position only: after eviction, the drafter's
    logits equal a fresh forward over the sinks, the window and the last feed at their true positions
    (rotary positions stay right when the middle leaves). Rows of different lengths (holes) included."""
    from specdec.decode.drafters.long_draft import LongDrafter

    model = tiny_llama(seed=1, layers=1, hidden=32, max_pos=1024)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (203, 150)]
    drafter = LongDrafter(model, WINDOW, SINKS)
    batch = SimpleNamespace(seqs=[list(s) for s in seqs], device=torch.device("cpu"), compile="off")
    drafter.begin(batch, None)
    with torch.no_grad():
        got = drafter._feed_pending(batch)
        assert drafter.state.length <= SINKS + WINDOW
        for r, seq in enumerate(seqs):
            n = len(seq)
            # the last feed held this row's final `pending` tokens; before it the cache kept sinks + window
            pending = n
            while pending > WINDOW:
                pending -= min(WINDOW, pending - WINDOW)
            kept = list(range(SINKS)) + list(range(n - pending - WINDOW, n))
            ref = model(input_ids=torch.tensor([[seq[i] for i in kept]]), position_ids=torch.tensor([kept])).logits[0, -1]
            assert torch.allclose(got[r], ref, atol=1e-8), r
        # and the next token continues from the true positions
        for seq in batch.seqs:
            seq.append(5)
        nxt = drafter._feed_pending(batch)
        for r, seq in enumerate(batch.seqs):
            n = len(seq)
            kept = list(range(SINKS)) + list(range(n - 1 - WINDOW, n))
            ref = model(input_ids=torch.tensor([[seq[i] for i in kept]]), position_ids=torch.tensor([kept])).logits[0, -1]
            assert torch.allclose(nxt[r], ref, atol=1e-8), r


def test_long_prompt_keeps_the_draft_cache_constant_and_decodes_as_ar(long):
    from specdec.decode.drafters.long_draft import LongDrafter
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.options import DecodeOptions
    from specdec.models.loading import load_target

    root, _, _ = long
    target, tok, _ = load_target(root / "target")
    drafter = build_drafter(str(root / "draft"), target, tok, DecodeOptions())
    assert isinstance(drafter, LongDrafter) and (drafter.window, drafter.sinks) == (WINDOW, SINKS)
    sizes = []
    propose = drafter.propose

    def spy(batch):
        out = propose(batch)
        state = drafter.state
        sizes.append((state.length, int(state.valid.sum(-1).max()), state.cache.capacity, int(state.pos.min())))
        return out

    drafter.propose = spy
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (600, 430, 520)]
    reqs = [GenRequest(p, 20) for p in prompts]
    ar = SpecEngine(target, tok).generate(reqs)
    one = [SpecEngine(target, tok, drafter, num_draft=K).generate([r])[0] for r in reqs]  # batch size 1
    three = SpecEngine(target, tok, drafter, num_draft=K).generate(reqs)  # batch size 3
    assert [r.token_ids for r in one] == [r.token_ids for r in ar]
    assert [r.token_ids for r in three] == [r.token_ids for r in ar]
    assert sum(r.stats["drafted_tokens"] for r in three) > 0
    # the cache holds the sinks and the window, plus this round's drafts, however long the text
    assert sizes and all(length <= SINKS + WINDOW + K - 1 for length, _, _, _ in sizes)
    assert max(pos for *_, pos in sizes) > 600 - 1 and min(pos for *_, pos in sizes) > 400
    assert max(cap for _, _, cap, _ in sizes) <= 256  # constant buffers: one capacity step
    # continuous batching: rows admitted into a running batch are prefilled the same way
    streamed = dict(SpecEngine(target, tok, drafter, num_draft=K).stream(reqs, 2))
    assert [streamed[i].token_ids for i in range(3)] == [r.token_ids for r in ar]
    assert all(length <= SINKS + WINDOW + K - 1 for length, _, _, _ in sizes)


def test_results_report_the_key_value_memory(long):
    """Each result carries its batch's cache sizes: the long draft's stays at its constant buffers however long
    the prompt, the same draft run plainly keeps every slot, and the target's grows with the text."""
    from specdec.decode.drafters.draft_model import ModelDrafter
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.options import DecodeOptions
    from specdec.models.loading import load_target

    root, _, _ = long
    target, tok, _ = load_target(root / "target")
    long_drafter = build_drafter(str(root / "draft"), target, tok, DecodeOptions())
    g = torch.Generator().manual_seed(5)
    held = {}
    for n in (300, 900):
        req = GenRequest(torch.randint(3, len(tok), (n,), generator=g).tolist(), 8)
        for name, drafter in (("long", long_drafter), ("plain", ModelDrafter(long_drafter.model))):
            res = SpecEngine(target, tok, drafter, num_draft=K).generate([req])[0]
            held[name, n] = (res.stats["target_cache_bytes"], res.stats["draft_cache_bytes"])
            # what the state holds now: the buffers it had when the row finished (they never shrink)
            assert res.stats["draft_cache_bytes"] == drafter.state.cache_bytes() > 0
    cfg = long_drafter.model.config
    slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # fp32 keys + values
    assert held["long", 900][1] == held["long", 300][1] <= 256 * slot
    assert held["plain", 900][1] >= 900 * slot > held["long", 900][1]
    assert held["plain", 900][0] > held["plain", 300][0] > 0


def test_cli_long_context(long, tmp_path):
    root, _, _ = long
    res = invoke(["train-draft", "--target", root / "target", "--data", root / "data.jsonl", "--out", tmp_path / "cli",
                  "--arch", "layers=1,hidden=32,heads=4", "--long-context", "--window", "8", "--sinks", "2",
                  "--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--checkpoint-every", "0", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["specdec_long"]["window"] == 8
    res = invoke(["train-draft", "--target", root / "target", "--data", root / "data.jsonl", "--out", tmp_path / "bad",
                  "--window", "8"])
    assert res.exit_code == 2 and "--long-context" in res.output


def test_sampling_keeps_the_target_joint_distribution():
    """Under sampling, a drafter whose cache evicts (window 2, 1 sink, over an 8-token prompt) keeps the
    target's distribution of the first two tokens."""
    from conftest import ByteTokenizer
    from test_sampling import P_FLOOR, two_token_pvalue

    from specdec.decode.drafters.long_draft import LongDrafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.engine.verify import Sampling

    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = LongDrafter(tiny_llama(vocab=vocab, hidden=32, layers=1, seed=4), window=2, sinks=1)
    prompt = [5, 7, 5, 7, 5, 3, 9, 4]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert drafter.state.length <= 1 + 2 + 3
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
