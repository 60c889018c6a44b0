"""dLLM training on tiny models: masked CE, from-config training, Learn2PD filter, certainty forcing, CLI."""

from __future__ import annotations

import json

import pytest
from conftest import invoke
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.models.artifacts import artifact_kind
from specdec.decode.diffusion.generator import DiffusionGenerator
from specdec.models.dllm import load_dllm, load_filter
from specdec.decode.engine.types import GenRequest
from specdec.train.trainers.dllm import (
    CertaintyForcingCollate,
    DllmTrainConfig,
    Example,
    certainty_terms,
    self_generated_examples,
    train_dllm,
)
from specdec.train.trainers.filter import train_filter
from specdec.train.prompts import code_prompts
from specdec.bench.quality import first_line_matches
from specdec.train.listtasks import OPERATIONS, WORDS, list_tasks

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAST = dict(seq_len=32, batch_size=8, warmup_steps=5, lr=3e-3, progress=False)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: extra threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


def word_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = ["<pad>", "<eos>", "<unk>", ":", "answer", *OPERATIONS, *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def ar_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ar")
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **TINY)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def task_pairs(n: int, split: str = "train"):
    return [(t.prompt, t.completion) for t in list_tasks(n, seed=0, split=split)]


@pytest.fixture(scope="module")
def dllm(ar_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dllm")
    metrics = train_dllm(ar_dir, ["apple pear fig " * 20], out, block_size=8, max_steps=60, extra_examples=task_pairs(200), **FAST)
    return out, metrics


def test_list_tasks_are_deterministic_and_splits_disjoint():
    train, heldout = list_tasks(300, seed=3), list_tasks(50, seed=3, split="heldout")
    assert train == list_tasks(300, seed=3)
    assert not set(train) & set(heldout)
    task = train[0]
    assert first_line_matches(task.completion + "trailing\nlines", task.answer)


def test_train_dllm_loss_falls_and_artifact_decodes(dllm):
    out, metrics = dllm
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["heldout_masked_ce"] < metrics["heldout_masked_ce_before"]
    assert artifact_kind(out) == "dllm"
    assert {"metrics.json", "train_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    model, tokenizer, spec = load_dllm(out)
    assert spec.mask_token_id == tokenizer.mask_token_id and spec.attention == "block" and spec.token_shift
    prompt = tokenizer(list_tasks(1, split="heldout")[0].prompt)["input_ids"]
    result = DiffusionGenerator(model, tokenizer, spec, "threshold", gen_length=16, block_size=8).generate([GenRequest(prompt, 16)])
    assert len(result[0].token_ids) <= 16


def test_train_dllm_from_config(tmp_path, ar_dir):
    config = {"vocab_size": 64, **TINY}
    metrics = train_dllm(None, ["apple pear fig " * 20], tmp_path / "scratch", block_size=8, attention="bidirectional", max_steps=15, model_config=config, tokenizer_dir=ar_dir, **FAST)
    assert metrics["steps"] == 15
    _, _, spec = load_dllm(tmp_path / "scratch")
    assert spec.attention == "bidirectional"


def test_train_filter_loss_falls(dllm, tmp_path):
    out, _ = dllm
    prompts = [t.prompt for t in list_tasks(8, seed=1)]
    metrics = train_filter(out, prompts, tmp_path / "filter", gen_length=16, block_size=8, max_steps=150)
    assert metrics["loss_last"] < metrics["loss_first"]
    assert artifact_kind(tmp_path / "filter") == "filter" and load_filter(tmp_path / "filter").width == 8
    model, tokenizer, spec = load_dllm(out)
    gen = DiffusionGenerator(model, tokenizer, spec, "learn2pd", gen_length=16, block_size=8, filter_dir=tmp_path / "filter")
    assert len(gen.generate([GenRequest(tokenizer(prompts[0])["input_ids"], 16)])) == 1


def test_filter_labelling_stops_at_its_deadline(dllm):
    import time

    from specdec.train.trainers.filter import FilterTrainConfig, collect_filter_data

    out, _ = dllm
    model, tokenizer, spec = load_dllm(out)
    prompts = [t.prompt for t in list_tasks(6, seed=2)]
    cfg = FilterTrainConfig(gen_length=8, block_size=8, decode_batch_size=2, cache="prefix")
    assert collect_filter_data(model, tokenizer, spec, prompts, cfg).prompts == 6
    assert collect_filter_data(model, tokenizer, spec, prompts, cfg, deadline=time.monotonic()).prompts == 2, "one batch always runs"


def test_certainty_forcing_lora_reduces_its_loss(dllm, tmp_path):
    out, _ = dllm
    metrics = train_dllm(
        out, [], tmp_path / "cf", block_size=8, max_steps=40, certainty_forcing=True, lora=True, extra_examples=task_pairs(16),
        lora_rank=8, cf_prompts=16, cf_gen_length=16, cf_cache="prefix", **FAST,
    )  # fmt: skip
    assert metrics["objective"] == "certainty_forcing" and metrics["self_generated"] == 16
    assert metrics["loss_last"] < metrics["loss_first"]
    model, _, _ = load_dllm(tmp_path / "cf")  # LoRA merged: a plain dLLM again
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert model.config.dllm_training == ["masked_ce", "certainty_forcing"]


def cf_rows() -> list[Example]:
    # prompts of 3 and 5 tokens; answers of 3 blocks of 4, 1 block + 2 tokens, 2 blocks
    return [Example(list(range(3 + 12)), 3), Example(list(range(5 + 6)), 5), Example(list(range(4 + 8)), 4)]


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_certainty_forcing_views_are_complementary_over_the_current_block(attention):
    from specdec.models.dllm import DllmSpec

    mask = 99
    spec = DllmSpec(mask, eos_token_id=1, attention=attention, block_size=4)
    collate = CertaintyForcingCollate(spec, DllmTrainConfig(block_size=4), seed=0)
    rows = cf_rows()
    currents = set()
    for _ in range(20):
        batch = collate(rows)
        sup, noisy, targets, valid = batch["supervised"], batch["noisy"], batch["targets"], batch["valid"]
        a, b = sup.chunk(2)
        assert not (a & b).any(), "the two views supervise disjoint tokens"
        for r, ex in enumerate(rows):
            covered = (a | b)[r].nonzero()[:, 0].tolist()
            rel = [j - ex.prompt_len for j in covered]
            block = rel[0] // 4
            currents.add((r, block))
            # every answer token of exactly one block (the current one) is supervised once
            assert rel == list(range(4 * block, min(4 * block + 4, len(ex.ids) - ex.prompt_len)))
            for view in (r, r + len(rows)):
                is_mask = noisy[view] == mask
                width = min(len(ex.ids), noisy.shape[1])
                before = torch.arange(width) < ex.prompt_len + 4 * block
                after = torch.arange(width) >= ex.prompt_len + 4 * block + 4
                assert not is_mask[:width][before].any(), "prompt and earlier blocks are clean"
                assert torch.equal(is_mask[:width] & ~after, sup[view, :width]), "inside the current block MASK = supervised"
                if attention == "block":  # later blocks cannot reach the current one: hidden or cut off
                    assert not valid[view, :width][after].any()
                else:
                    assert is_mask[:width][after].all(), "later blocks are fully masked"
            assert torch.equal(noisy[~(noisy == mask)], targets[~(noisy == mask)])
    assert len(currents) > len(rows), "the current block varies"


def test_certainty_terms_entropy_counts_only_correct_masked_tokens():
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 6, 10), torch.randint(0, 10, (4, 6))
    supervised = torch.rand(4, 6) < 0.6
    logits[0, :3] = 0.0
    logits[0, torch.arange(3), targets[0, :3]] = 5.0  # certainly correct there
    supervised[0, :3] = True
    ce, entropy = certainty_terms(logits, targets, supervised, temperature=0.5)
    correct = supervised & (logits.argmax(-1) == targets)
    p = torch.softmax(logits / 0.5, -1)
    h = -(p * p.log()).sum(-1)
    for v, rows in enumerate((slice(0, 2), slice(2, 4))):
        assert torch.isclose(entropy[v], h[rows][correct[rows]].mean())
        expected_ce = torch.nn.functional.cross_entropy(logits[rows][supervised[rows]], targets[rows][supervised[rows]])
        assert torch.isclose(ce[v], expected_ce)
    # wrong or unsupervised predictions do not enter the entropy term, whatever their distribution
    noisy = logits + 3 * torch.randn_like(logits) * (~correct)[..., None]
    noisy[~correct] = noisy[~correct].scatter(-1, targets[~correct][:, None], -1e4)
    assert torch.allclose(certainty_terms(noisy, targets, supervised, 0.5)[1], entropy)


def test_self_generated_examples_are_static_greedy_decodes(dllm):
    out, _ = dllm
    model, tokenizer, spec = load_dllm(out)
    cfg = DllmTrainConfig(block_size=8, cf_gen_length=24, cf_decode_batch=3)
    prompts = [t.prompt for t in list_tasks(5, seed=4)]
    own = self_generated_examples(model, tokenizer, spec, prompts, cfg)
    static = DiffusionGenerator(model, tokenizer, spec, "static", gen_length=24, block_size=8)
    by_prompt = {tuple(ex.ids[: ex.prompt_len]): ex.ids[ex.prompt_len :] for ex in own}
    assert len(own) == 5
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        (r,) = static.generate([GenRequest(ids, 24)])
        answer = by_prompt[tuple(ids)]
        assert answer[: len(r.token_ids)] == r.token_ids
        if r.finish_reason == "stop":  # the EOS-filled block ends the example
            assert set(answer[len(r.token_ids) :]) == {spec.eos_token_id} and len(answer) % 8 == 0
        else:
            assert len(answer) == 24


def python_text(seed: int) -> str:
    lines = ["import os", ""]
    for k in range(12):
        lines += [f"def f{seed}_{k}(a, b):", "    x = a + b", "    return x", ""]
        lines += [f"class C{k}:", f'    """Holds {k}', '    and more."""', ""]
        lines += [f"TABLE{k} = [", "    1, 2, 3,", "]", ""]
    return "\n".join(lines)


def test_code_prompts_end_at_anchors_within_the_length_range():
    from specdec.train.prompts import _ANCHORS

    tokenizer = word_tokenizer()
    texts = [python_text(i) for i in range(4)]
    prompts = code_prompts(tokenizer, texts, 9, seed=0, min_tokens=10, max_tokens=60)
    assert prompts == code_prompts(tokenizer, texts, 9, seed=0, min_tokens=10, max_tokens=60)
    assert len(prompts) == 9
    kinds = []
    for prompt in prompts:
        assert 10 <= len(tokenizer(prompt)["input_ids"]) <= 60
        lines = prompt.splitlines()
        kind = next(k for k, pat in _ANCHORS.items() if pat.match(lines[-1]) or (k == "code" and pat.match(lines[-2])))
        kinds.append(kind)
    assert kinds[:3] == list(_ANCHORS), "the three kinds take turns"


def test_cli_train_dllm_and_errors(tmp_path, ar_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in task_pairs(20)) + "\n")
    result = invoke(["train-dllm", "--target", str(ar_dir), "--data", str(data), "--out", str(tmp_path / "d"), "--block-size", "8", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert artifact_kind(tmp_path / "d") == "dllm"
    bad = invoke(["train-filter", "--target", str(ar_dir), "--data", str(data), "--out", str(tmp_path / "f")])
    assert bad.exit_code == 1 and "not a specdec dLLM" in bad.output
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"prompt": python_text(i)}) for i in range(3)) + "\n")
    args = ["train-filter", "--target", str(tmp_path / "d"), "--data", str(texts), "--out", str(tmp_path / "f"), "--gen-length", "8", "--block-size", "8"]
    result = invoke([*args, "--code-prompts", "2", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "f" / "metrics.json").read_text())["prompts"] == 2


def test_bench_reports_every_method(dllm, tmp_path):
    from specdec.bench.diffusion_bench import bench_diffusion, render_table
    from specdec.bench.report import plot

    out, _ = dllm
    train_filter(out, [t.prompt for t in list_tasks(4, seed=1)], tmp_path / "filter", gen_length=16, block_size=8, max_steps=20)
    records = [t.record(i) for i, t in enumerate(list_tasks(4, split="heldout"))]
    methods = ["freedave", "threshold+tau=0.5", "static+cache=dual", f"learn2pd+filter={tmp_path / 'filter'}"]
    report = bench_diffusion(out, records, methods, gen_length=16, block_size=8, batch_size=2, repeats=1, warmup=0)
    rows = {row["method"]: row for row in report["methods"]}
    assert list(rows) == ["static", *methods]
    assert rows["static"]["speedup"] == 1.0 and rows["static"]["exact_match"] == 1.0
    assert rows["freedave"]["exact_match"] == 1.0 and rows["freedave"]["forwards_per_token"] <= rows["static"]["forwards_per_token"]
    assert rows["static+cache=dual"]["approximate"] and not rows["threshold+tau=0.5"]["approximate"]
    assert all(row["task_accuracy"] is not None for row in rows.values())
    assert render_table(report).row_count == len(rows)
    assert plot(report, tmp_path / "plot.png").stat().st_size > 0


def test_train_dllm_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path, ar_dir, monkeypatch):
    """Checkpoints under OUT/checkpoints, and a run that crashed after one of them resumes to the
    weights an uninterrupted run reaches (the masks are drawn per micro-batch, not from a running stream)."""
    from safetensors.torch import load_file

    from specdec.train.trainers import dllm as dllm_module

    kwargs = dict(block_size=8, max_steps=6, extra_examples=task_pairs(40), checkpoint_every=2, **FAST)
    train_dllm(ar_dir, [], tmp_path / "full", **kwargs)
    real, calls = dllm_module.masked_diffusion_loss, {"n": 0}

    def crash_at_step_5(model, batch, spec):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(model, batch, spec)

    monkeypatch.setattr(dllm_module, "masked_diffusion_loss", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train_dllm(ar_dir, [], tmp_path / "split", **kwargs)
    monkeypatch.undo()
    assert (tmp_path / "split" / "checkpoints" / "step-4").is_dir()
    resumed = train_dllm(ar_dir, [], tmp_path / "split", resume=True, **kwargs)
    assert resumed["steps"] == 6
    full, split = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" / "model.safetensors"))
    assert full.keys() == split.keys() and all(torch.equal(full[k], split[k]) for k in full)


def test_cli_dllm_trainers_take_the_shared_placement_options(tmp_path, ar_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in task_pairs(20)) + "\n")
    out = tmp_path / "d"
    args = ["train-dllm", "--target", ar_dir, "--data", data, "--out", out, "--block-size", "8", "--max-steps", "2",
            "--device", "cpu", "--threads", "1", "--attn-implementation", "eager", "--checkpoint-every", "1"]
    assert invoke(args).exit_code == 0
    assert (out / "checkpoints" / "step-2").is_dir()
    again = invoke([*args, "--resume"])  # the newest checkpoint is the end: nothing left to train
    assert again.exit_code == 0, again.output
    refused = invoke([*args, "--dtype", "bfloat16"])
    assert refused.exit_code == 2 and "--dtype" in refused.stderr
    assert invoke([*args, "--threads", "-1"]).exit_code == 2
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"prompt": python_text(i)}) for i in range(3)) + "\n")
    res = invoke(["train-filter", "--target", out, "--data", texts, "--out", tmp_path / "f", "--gen-length", "8", "--block-size", "8",
                  "--code-prompts", "2", "--max-steps", "3", "--device", "cpu", "--dtype", "float32", "--threads", "1",
                  "--checkpoint-every", "1"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "f" / "checkpoints" / "step-3").is_dir()
