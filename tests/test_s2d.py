"""S2D (sorted speculative decoding): one sorted draft whose first layers serve several targets sharing a
tokenizer (train.trainers.draft with several targets, decode.drafters.draft_model.s2d_view)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import invoke, save_tiny_lm, tiny_tokenizer

from specdec.models.errors import SpecdecError
from specdec.train.loop import config_from_dict

LINES = ["def add(a, b):", "    return a + b", "class Point:", "    def __init__(self, x, y):", "        self.x = x",
         "for i in range(10):", "    print(i * i)", "import os", "import sys", "path = os.path.join('a', 'b')"]


def tiny_cfg(**kw):
    base = dict(lr=1e-2, steps=10, batch=4, seq_len=32, warmup=1, checkpoint_every=0, progress=False, log_every=1, heldout=0.15)
    base.update(kw)
    return config_from_dict(base)


def write_data(path, n: int = 160, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": "\n".join(rng.choice(LINES) for _ in range(rng.randint(2, 5))) + "\n"}) + "\n")
    return path


@pytest.fixture(scope="module")
def s2d(tmp_path_factory):
    """Two targets of one tokenizer (1 layer of 32, 3 layers of 48) and a 2-layer sorted draft trained on both."""
    from specdec.train.trainers.draft import train_draft

    root = tmp_path_factory.mktemp("s2d")
    tok = tiny_tokenizer()
    save_tiny_lm(root / "small", tok, seed=3, layers=1, hidden=32)
    save_tiny_lm(root / "large", tok, seed=4, layers=3, hidden=48)
    write_data(root / "data.jsonl")
    metrics = train_draft([root / "small", root / "large"], [root / "data.jsonl"], root / "sorted", tiny_cfg(steps=12),
                          arch="layers=2,hidden=32,heads=4", kd_weight=1.0)
    return root, metrics


def test_one_artifact_records_a_depth_per_target_and_trains_both(s2d):
    root, m = s2d
    cfg = json.loads((root / "sorted" / "config.json").read_text())
    meta = cfg["specdec_s2d"]
    # by size: the smaller target gets the first layer, the larger the whole draft
    assert meta["depths"] == {"small": 1, "large": 2} and meta["layers"] == 2
    assert {t["name"]: t["depth"] for t in meta["targets"]} == {"small": 1, "large": 2}
    for name in ("small", "large"):
        curve = m["s2d"][name]["loss_curve"]
        assert len(curve) == 12
        assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3, (name, curve)
        assert 1.0 <= m["s2d"][name]["expected_tau"]["1"]


def test_each_target_decodes_at_its_depth_exactly_as_ar(s2d):
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.options import DecodeOptions
    from specdec.models.arch import decoder_layers
    from specdec.models.loading import load_target

    root, _ = s2d
    for name, depth in (("small", 1), ("large", 2)):
        target, tok, _ = load_target(root / name)
        drafter = build_drafter(str(root / "sorted"), target, tok, DecodeOptions())
        assert len(decoder_layers(drafter.model)[2]) == depth == drafter.model.config.num_hidden_layers
        prompts = [tok(t)["input_ids"] for t in ("def add(a, b):\n", "class Point:\n    def", "for i in range(")]
        reqs = [GenRequest(p, 12) for p in prompts]
        ar = SpecEngine(target, tok).generate(reqs)
        one = [SpecEngine(target, tok, drafter, num_draft=3).generate([r])[0] for r in reqs]  # batch size 1
        three = SpecEngine(target, tok, drafter, num_draft=3).generate(reqs)  # batch size 3
        assert [r.token_ids for r in one] == [r.token_ids for r in ar], name
        assert [r.token_ids for r in three] == [r.token_ids for r in ar], name
        assert sum(r.stats["drafted_tokens"] for r in three) > 0


def test_depth_taps_are_the_sub_models_logits():
    """One forward's depth-n logits (DepthTaps) are what the first n layers compute alone (layer_skip_view)."""
    from conftest import tiny_llama

    from specdec.decode.drafters.self_speculation import layer_skip_view
    from specdec.train.trainers.draft import DepthTaps

    model = tiny_llama(seed=2, layers=3)
    ids = torch.randint(3, 96, (2, 11))
    taps = DepthTaps(model, [1, 2, 3])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        for depth in (1, 2):
            alone = layer_skip_view(model, list(range(depth, 3)))(input_ids=ids).logits
            assert torch.allclose(taps.logits(depth, full), alone, atol=1e-9)
        assert taps.logits(3, full) is full
    taps.close()
    assert not model.model.layers[0]._forward_hooks


def test_depth_rule_and_assignment():
    from conftest import tiny_llama

    from specdec.decode.drafters.draft_model import s2d_depth, target_identity
    from specdec.train.trainers.draft import assign_depths

    a, b = tiny_llama(layers=2).config, tiny_llama(layers=3).config
    meta = {"targets": [{"name": "a", "source": "/m/a", "identity": target_identity(a), "depth": 1},
                        {"name": "b", "source": "/m/b", "identity": target_identity(b), "depth": 2}]}
    assert s2d_depth(meta, a, "whatever", 4) == 1 and s2d_depth(meta, b, None, 4) == 2
    assert s2d_depth(meta, tiny_llama(layers=4).config, "/m/a", 4) == 4  # an unknown target: the full depth
    # two recorded targets of one architecture: the name decides, else the full depth
    twins = {"targets": [{"name": "base", "source": "/m/base", "identity": target_identity(a), "depth": 1},
                         {"name": "chat", "source": "/m/chat", "identity": target_identity(a), "depth": 3}]}
    assert s2d_depth(twins, a, "org/chat", 4) == 3 and s2d_depth(twins, a, "/m/base", 4) == 1
    assert s2d_depth(twins, a, "other", 4) == 4
    assert assign_depths([10, 30, 20], 4) == [2, 4, 3] and assign_depths([5, 5], 2) == [1, 2]
    assert assign_depths([1, 2], 4, [4, 1]) == [4, 1]
    with pytest.raises(SpecdecError, match="between 1"):
        assign_depths([1, 2], 2, [1, 3])
    with pytest.raises(SpecdecError, match="deepest"):
        assign_depths([1, 2], 2, [1, 1])


def test_targets_must_share_a_tokenizer_and_cli(s2d, tmp_path):
    from specdec.train.trainers.draft import train_draft

    root, _ = s2d
    other = tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    save_tiny_lm(tmp_path / "foreign", other, seed=5, layers=1, hidden=32)
    with pytest.raises(SpecdecError, match="share a tokenizer"):
        train_draft([root / "small", tmp_path / "foreign"], [root / "data.jsonl"], tmp_path / "x", tiny_cfg(steps=1),
                    arch="layers=2,hidden=32,heads=4")
    # the CLI: --targets with explicit depths (the recipe's cached teacher: one cache per target)
    res = invoke(["train-draft", "--targets", f"{root / 'small'},{root / 'large'}", "--data", root / "data.jsonl",
                  "--out", tmp_path / "cli", "--arch", "layers=2,hidden=32,heads=4", "--s2d-depths", "2,1",
                  "--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--checkpoint-every", "0", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["specdec_s2d"]["depths"] == {"small": 2, "large": 1}
    assert (tmp_path / "cli" / "teacher_cache-1.safetensors").exists()
    res = invoke(["train-draft", "--target", root / "small", "--targets", f"{root / 'small'},{root / 'large'}",
                  "--data", root / "data.jsonl", "--out", tmp_path / "bad"])
    assert res.exit_code == 2 and "--targets" in res.output


def _exit_drafter(root, target_name, threshold, **drafting):
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.options import DecodeOptions, DraftingOptions
    from specdec.models.loading import load_target

    target, tok, _ = load_target(root / target_name)
    opts = DecodeOptions(drafting=DraftingOptions(drafter=str(root / "sorted"), exit_threshold=threshold, **drafting))
    return target, tok, build_drafter(str(root / "sorted"), target, tok, opts)


def test_depth_per_step_by_confidence_decodes_as_ar(s2d):
    """--exit-threshold: the sorted draft's first layer drafts where it is sure enough, its two layers
    elsewhere (each with a cache of its own); greedy output is ar's at bs 1 and 3 whatever the mix."""
    from specdec.decode.drafters.draft_model import SortedExitDrafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest

    root, _ = s2d
    target, tok, drafter = _exit_drafter(root, "large", 0.0)
    prompts = [tok(t)["input_ids"] for t in ("def add(a, b):\n", "class Point:\n    def", "for i in range(")]
    with torch.no_grad():  # the shallow sub-model's top probabilities on the prompts: a threshold that splits them
        tops = torch.cat([drafter.model(input_ids=torch.tensor([p])).logits.softmax(-1).amax(-1).flatten() for p in prompts])
    reqs = [GenRequest(p, 14) for p in prompts]
    ar = [r.token_ids for r in SpecEngine(target, tok).generate(reqs)]
    for threshold in (0.0, float(tops.median()), 1.0):
        target, tok, drafter = _exit_drafter(root, "large", threshold)
        assert isinstance(drafter, SortedExitDrafter) and drafter.depths == (1, 2)
        one = [SpecEngine(target, tok, drafter, num_draft=4).generate([r])[0].token_ids for r in reqs]
        three = SpecEngine(target, tok, drafter, num_draft=4).generate(reqs)
        assert one == ar and [r.token_ids for r in three] == ar, threshold
        assert sum(r.stats["drafted_tokens"] for r in three) > 0
        streamed = dict(SpecEngine(target, tok, drafter, num_draft=4).stream(iter(reqs), 2))  # rows admitted mid-batch
        assert [streamed[i].token_ids for i in range(len(reqs))] == ar, threshold
        steps = drafter.steps
        if threshold == 0.0:
            assert steps["deep"] == 0 and steps["shallow"] > 0
        elif threshold == 1.0:
            assert steps["shallow"] == 0 and steps["deep"] > 0
        else:
            assert steps["deep"] > 0 and steps["shallow"] > 0, steps


def test_depth_per_step_keeps_the_sampling_distribution():
    """At T = 0.8 a sorted draft switching depth per step (each token's distribution the one it was drawn
    from) leaves the target's joint distribution of two tokens unchanged."""
    from conftest import ByteTokenizer, tiny_llama
    from specdec.tests.test_sampling import P_FLOOR, two_token_pvalue

    from specdec.decode.drafters.draft_model import SortedExitDrafter, target_identity
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.decode.engine.verify import Sampling

    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    draft = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=4)
    draft.config.specdec_s2d = {"layers": 2, "targets": [
        {"name": "small", "source": "/m/small", "identity": "0" * 16, "depth": 1},
        {"name": "t", "source": "/m/t", "identity": target_identity(target.config), "depth": 2}]}
    prompt = [5, 7, 5, 7, 5]
    drafter = SortedExitDrafter.from_sorted(draft, target, 1.0)
    with torch.no_grad():  # a threshold splitting the shallow sub-model's top probabilities after the first token
        after = torch.tensor([prompt + [t] for t in range(vocab)])
        tops = drafter.model(input_ids=after).logits[:, -1].softmax(-1).amax(-1)
    drafter.threshold = float(tops.median())
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert drafter.steps["deep"] > 0 and drafter.steps["shallow"] > 0
    assert sum(r.stats["accepted_tokens"] for r in res) > 0
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR


def test_depth_per_step_refuses_what_it_cannot_do(s2d, tiny_family, tmp_path):
    from specdec.models.errors import UsageError

    root, _ = s2d
    with pytest.raises(UsageError, match="no shallower"):
        _exit_drafter(root, "small", 0.5)  # the small target already runs the shallowest sub-model
    with pytest.raises(UsageError, match="does not combine"):
        _exit_drafter(root, "large", 0.5, parallel=True)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    for drafter, value, message in ((tiny_family / "draft", "0.5", "sorted (S2D) draft"), (root / "sorted", "1.5", "--exit-threshold must be")):
        res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", root / "large" if "sorted" in str(drafter) else tiny_family / "target",
                      "--drafter", drafter, "--exit-threshold", value, "--max-new-tokens", "4", "--overwrite"])
        assert res.exit_code == 2 and message in res.output, res.output
        assert "Traceback" not in res.output
