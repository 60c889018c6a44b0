"""FSPAD as an option of the EAGLE trainer: feature sampling (the token's embedding gates the fused
entry) and partial alignment distillation (the feature loss covers only the first ``fspad_align`` of
the predicted feature's dimensions); decoding with an FSPAD head stays exactly the target's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama

from specdec.decode.drafters.heads import EagleDrafter
from specdec.decode.drafters.heads import build_head_drafter as build_drafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.heads import EagleHead
from specdec.tests.test_train import write_decode_output


def _fspad_head(target, align=0.5, seed=0, sampler_scale=0.3, **kw):
    """An FSPAD head on ``target`` whose sampler is no longer the identity (random down projection)."""
    torch.manual_seed(seed)
    head = EagleHead(target.config, fspad=True, fspad_align=align, **kw).attach(target).double()
    with torch.no_grad():
        torch.nn.init.normal_(head.sampler.down_proj.weight, std=sampler_scale)
    return head


def _one_error_line(res, code=2):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------
# the loss


def test_partial_alignment_ignores_the_unaligned_dims(target):
    """With ce_weight 0 the trainer's loss has no gradient on the unaligned output dims; the token
    loss (ce_weight > 0) does reach them; the regression term never reads them."""
    head = _fspad_head(target, align=0.25, noise=0.0)
    h = target.config.hidden_size
    k = head.aligned_dims(h)
    assert k == 12
    ids = torch.tensor([make_prompts(2, seed=5, lo=14, hi=15)[0][:16]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    grads = {}
    for ce_weight in (0.0, 0.1):
        head.ce_weight = ce_weight
        seen = []
        run = EagleHead.run

        def spy(x, mask, pos, store=None):
            o = run(head, x, mask, pos, store)
            o.retain_grad()
            seen.append(o)
            return o

        head.run = spy
        head.zero_grad()
        loss, _ = head(out.hidden_states, ids, out.logits)
        loss.backward()
        del head.run
        grads[ce_weight] = seen[0].grad
    assert grads[0.0][..., :k].abs().sum() > 0
    assert torch.count_nonzero(grads[0.0][..., k:]) == 0
    assert grads[0.1][..., k:].abs().sum() > 0  # free for the token loss
    # the regression term itself: zero gradient past k, blind to the target's unaligned dims
    pred = torch.randn(2, 5, h, dtype=torch.float64, requires_grad=True)
    true = torch.randn(2, 5, h, dtype=torch.float64)
    head.regression_loss(pred, true).backward()
    assert torch.count_nonzero(pred.grad[..., k:]) == 0 and torch.count_nonzero(pred.grad[..., :k]) > 0
    moved = true.clone()
    moved[..., k:] += 3.0
    assert head.regression_loss(pred, moved) == head.regression_loss(pred, true)


def test_full_alignment_is_eagles_loss(target):
    """fspad_align=1.0 with a fresh (identity) sampler: exactly plain EAGLE's regression and token terms."""
    torch.manual_seed(0)
    plain = EagleHead(target.config, noise=0.0).attach(target).double()
    full = EagleHead(target.config, noise=0.0, fspad=True, fspad_align=1.0).attach(target).double()
    half = EagleHead(target.config, noise=0.0, fspad=True, fspad_align=0.5).attach(target).double()
    for head in (full, half):
        missing, unexpected = head.load_state_dict(plain.state_dict(), strict=False)
        assert all(m.startswith("sampler.") for m in missing) and missing and not unexpected
    ids = torch.tensor([make_prompts(1, seed=6, lo=14, hi=15)[0][:16]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        parts = [h(out.hidden_states, ids, out.logits)[1] for h in (plain, full, half)]
        fh = plain.unrolled(out.hidden_states, ids, 1)[0]
    assert parts[1] == parts[0]
    assert parts[2]["ce0"] == parts[0]["ce0"] and parts[2]["reg0"] != parts[0]["reg0"]
    f = out.hidden_states[-1][:, 1:]
    ref = torch.nn.functional.smooth_l1_loss(fh[..., :24].float(), f[..., :24].float())
    assert parts[2]["reg0"] == pytest.approx(float(ref), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# decoding


def test_the_drafter_samples_features_as_training_does(target):
    """The decode side runs the head's sampler in its entries: the root feature after the prefill
    equals the training-time chain's step at the prompt's last token, and the sampler matters."""
    head = _fspad_head(target)
    prompt = make_prompts(1, seed=4)[0][:10]
    ids = torch.tensor([prompt + [7]])
    drafter = EagleDrafter(head, target, tree="static", tree_tokens=6, top_k=2)
    batch = SimpleNamespace(seqs=[prompt], device=ids.device, root=ids[:, -1])
    from specdec.decode.drafters.base import Segment

    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        chain = head.unrolled(hs, ids, 1)
        drafter.begin(batch, Segment(ids[:, :-1], torch.ones(1, len(prompt), dtype=torch.bool), None, hs[-1][:, :-1]))
        assert torch.allclose(drafter.f_root, chain[0, :, len(prompt) - 1], atol=1e-9)
        sampler, head.sampler = head.sampler, None
        plain = head.unrolled(hs, ids, 1)
        head.sampler = sampler
    assert not torch.allclose(plain, chain)


def test_fspad_sampling_at_t08_follows_the_target():
    """T=0.8: the two-token joint distribution of an FSPAD-drafted engine passes tests/test_sampling's
    chi-square test."""
    from specdec.tests.test_sampling import P_FLOOR, two_token_pvalue

    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    drafter = EagleDrafter(_fspad_head(target, seed=1), target, tree="static", tree_tokens=4, top_k=2)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(2000)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0


# ---------------------------------------------------------------------------------------------
# the trainer and the CLI (tiny_family's target, a few steps)


@pytest.fixture(scope="module")
def trained(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("fspad")
    write_decode_output(root / "data.jsonl", n=60)
    # the recipe's eagle section carries fspad_align (extra); --fspad turns FSPAD on
    (root / "heads.yaml").write_text(
        "eagle:\n  lr: 3.0e-3\n  steps: 12\n  batch: 4\n  seq_len: 32\n  warmup: 1\n  clip: 0.5\n  checkpoint_every: 0\n"
        "  heldout: 0.15\n  log_every: 1\n  progress: false\n  extra: {noise: 0.2, ce_weight: 0.1, unroll: 1, fspad_align: 0.25}\n")
    args = ["train-heads", "--kind", "eagle", "--target", tiny_family / "target", "--data", root / "data.jsonl",
            "--recipe", root / "heads.yaml"]
    res = invoke([*args, "--fspad", "--out", root / "fspad"])
    assert res.exit_code == 0, res.output
    return SimpleNamespace(root=root, out=root / "fspad", args=args, target=tiny_family / "target")


def test_train_heads_fspad_writes_an_fspad_artifact_and_its_loss_falls(trained):
    cfg = json.loads((trained.out / "config.json").read_text())
    assert cfg["kind"] == "eagle" and cfg["fspad"] is True and cfg["fspad_align"] == 0.25
    curve = json.loads((trained.out / "metrics.json").read_text())["loss_curve"]
    assert len(curve) == 12 and sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    assert "fspad: true" in (trained.out / "training_config.yaml").read_text()
    from safetensors.torch import load_file

    weights = load_file(str(trained.out / "model.safetensors"))
    assert weights["sampler.down_proj.weight"].abs().sum() > 0  # trained away from the identity


@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_decoding_with_the_trained_fspad_head_equals_ar(trained, tiny_family, bs):
    from specdec.models.loading import load_target

    target, tok, _ = load_target(tiny_family / "target")
    drafter = build_drafter(trained.out, target, tok, SimpleNamespace(num_draft=None, tree="static", tree_tokens=10))
    assert drafter.heads.sampler is not None
    texts = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n"][:bs]
    reqs = [GenRequest(prompt_ids=tok(t)["input_ids"], max_new_tokens=14) for t in texts]
    res = SpecEngine(target, tok, drafter).generate(reqs)
    ar = SpecEngine(target, tok, None).generate(reqs)
    assert [r.token_ids for r in res] == [r.token_ids for r in ar]
    assert all(r.stats["drafted_tokens"] > 0 for r in res)


def test_fspad_refusals(trained):
    line = _one_error_line(invoke(["train-heads", "--kind", "medusa", "--fspad", "--target", trained.target,
                                   "--data", trained.root / "data.jsonl", "--out", trained.root / "m"]))
    assert "--fspad" in line and "eagle" in line
    line = _one_error_line(invoke([*trained.args, "--fspad", "--layout", "published", "--out", trained.root / "p"]))
    assert "--layout published" in line
    line = _one_error_line(invoke([*trained.args, "--fspad-align", "1.5", "--out", trained.root / "a"]))
    assert "--fspad-align" in line
    line = _one_error_line(invoke(["export", trained.out, "--to", "hf", "--out", trained.root / "x"]))
    assert "FSPAD" in line
