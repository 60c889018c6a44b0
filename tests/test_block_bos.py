"""Every trainer's blocks start as the target reads a prompt: with the tokens the tokenizer puts in front
of one (a BOS), and with nothing where it puts nothing (train.data.block_prefix / cut_blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.tests.test_train import corpus, make_target_dir, make_tokenizer, tiny_cfg, write_decode_output
from specdec.train.data import block_prefix, cut_blocks, tokenize_blocks

SEQ = 32


def bos_tokenizer(eos_too: bool = False):
    """The tests' tiny tokenizer, set to put <s> in front of every text it encodes (as Gemma's and Llama's do)."""
    from tokenizers.processors import TemplateProcessing

    tok = make_tokenizer(96, 0)
    single = "<s> $A </s>" if eos_too else "<s> $A"
    tok._tokenizer.post_processor = TemplateProcessing(
        single=single, special_tokens=[("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)])
    assert tok("the cat")["input_ids"][0] == tok.bos_token_id
    return tok


def gpt2_style_tokenizer():
    """BOS is EOS and nothing is put in front of a text (this project's own family tokenizers)."""
    from transformers import PreTrainedTokenizerFast

    inner = make_tokenizer(96, 0)._tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", bos_token="</s>", pad_token="<pad>")


def stream_of(tok, texts) -> list[int]:
    return [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def assert_bos_blocks(blocks: torch.Tensor, bos: int, seq_len: int = SEQ) -> None:
    """Every block is BOS + seq_len - 1 text tokens: one BOS, in front, none added twice."""
    assert blocks.ndim == 2 and blocks.shape[0] > 0 and blocks.shape[1] == seq_len
    assert (blocks[:, 0] == bos).all(), blocks[:, :3]
    assert not (blocks[:, 1:] == bos).any()


# ---------------------------------------------------------------------------------------------
# The shared path


def test_block_prefix_is_what_the_tokenizer_puts_in_front_of_a_prompt():
    assert block_prefix(bos_tokenizer()) == [1]
    assert block_prefix(bos_tokenizer(eos_too=True)) == [1]  # an appended EOS is not a prefix
    assert block_prefix(make_tokenizer(96, 0)) == []  # has a BOS token, never puts it in front
    assert block_prefix(gpt2_style_tokenizer()) == []


def test_every_block_starts_with_bos_and_carries_the_text_in_order():
    tok = bos_tokenizer()
    texts = corpus(60)
    train, held = tokenize_blocks(texts, tok, SEQ, heldout=0.0)
    assert len(held) == 0
    blocks = train[:]["input_ids"]
    assert_bos_blocks(blocks, tok.bos_token_id)
    stream = stream_of(tok, texts)
    assert blocks[:, 1:].reshape(-1).tolist() == stream[: blocks.shape[0] * (SEQ - 1)]
    # the held-out split is cut the same way
    train, held = tokenize_blocks(texts, tok, SEQ, heldout=0.2)
    assert_bos_blocks(held[:]["input_ids"], tok.bos_token_id)


@pytest.mark.parametrize("make", [lambda: make_tokenizer(96, 0), gpt2_style_tokenizer])
def test_a_tokenizer_that_puts_nothing_in_front_gets_plain_blocks(make):
    tok = make()
    texts = corpus(60)
    blocks = tokenize_blocks(texts, tok, SEQ, heldout=0.0)[0][:]["input_ids"]
    assert blocks.shape[1] == SEQ
    assert blocks.reshape(-1).tolist() == stream_of(tok, texts)[: blocks.numel()]
    if tok.bos_token_id != tok.eos_token_id:
        assert not (blocks == tok.bos_token_id).any()


def test_cut_blocks_keeps_the_block_length_and_refuses_a_block_of_prefix_only():
    from specdec.models.errors import UsageError

    blocks = cut_blocks(torch.arange(10, dtype=torch.int32), 4, [99])
    assert blocks.tolist() == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8]] and blocks.dtype == torch.int32
    assert cut_blocks(torch.arange(10), 4, []).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(UsageError):
        cut_blocks(torch.arange(10), 1, [99])


# ---------------------------------------------------------------------------------------------
# Each trainer's data path, stopped where training would start


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def bos_workdir(tmp_path_factory):
    """A tiny target whose tokenizer puts BOS in front of a prompt, and decode-output training data."""
    root = tmp_path_factory.mktemp("bos")
    make_target_dir(root / "target")
    bos_tokenizer().save_pretrained(root / "target")
    write_decode_output(root / "data.jsonl", n=80)
    return root


def capture_training(monkeypatch, module) -> dict:
    """Replace ``module.run_training`` by one that records the dataset and collate function it gets, then stops."""
    seen: dict = {}

    def fake(cfg, model, loss_fn, dataset, out_dir, resume=False, accelerator=None, collate_fn=None, label="train"):
        seen.update(dataset=dataset, collate=collate_fn)
        raise Stop

    monkeypatch.setattr(module, "run_training", fake)
    return seen


def blocks_of(dataset) -> torch.Tensor:
    return torch.stack([torch.as_tensor(dataset[i]["input_ids"]) for i in range(len(dataset))])


def test_train_draft_trains_on_bos_blocks(bos_workdir, monkeypatch):
    from specdec.train.trainers import draft

    seen = capture_training(monkeypatch, draft)
    with pytest.raises(Stop):
        draft.train_draft(bos_workdir / "target", [bos_workdir / "data.jsonl"], bos_workdir / "draft", tiny_cfg(seq_len=SEQ),
                          arch="layers=1,hidden=32,heads=4")
    assert_bos_blocks(blocks_of(seen["dataset"]), 1)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_train_heads_trains_on_bos_blocks(bos_workdir, monkeypatch, kind):
    from specdec.train.trainers import heads

    seen = capture_training(monkeypatch, heads)
    with pytest.raises(Stop):
        heads.train_heads(kind, bos_workdir / "target", [bos_workdir / "data.jsonl"], bos_workdir / kind, tiny_cfg(seq_len=SEQ))
    assert_bos_blocks(blocks_of(seen["dataset"]), 1)


@pytest.mark.parametrize("trainer", ["ppd", "lud"])
def test_packed_trainers_see_one_bos_and_do_not_learn_from_it(bos_workdir, monkeypatch, trainer):
    """PPD (train-heads' riding kinds) and train-lud pack their blocks: the packed input's block part is the
    block itself (BOS once, not put in front again), BOS's own next token is not learnt, no unit starts at it."""
    from specdec.train.trainers import heads, lud

    if trainer == "lud":
        seen = capture_training(monkeypatch, lud)
        run = lambda: lud.train_lud(bos_workdir / "target", [bos_workdir / "data.jsonl"], bos_workdir / "lud",  # noqa: E731
                                    tiny_cfg(seq_len=SEQ), cuts=4)
    else:
        seen = capture_training(monkeypatch, heads)
        run = lambda: heads.train_heads("ppd", bos_workdir / "target", [bos_workdir / "data.jsonl"],  # noqa: E731
                                        bos_workdir / "ppd", tiny_cfg(seq_len=SEQ))
    with pytest.raises(Stop):
        run()
    blocks = blocks_of(seen["dataset"])
    assert_bos_blocks(blocks, 1)
    packed = seen["collate"]([seen["dataset"][i] for i in range(4)])
    assert torch.equal(packed["input_ids"][:, :SEQ], blocks[:4])
    assert (packed["ntp_labels"][:, 0] == -100).all() and (packed["unit_pos"] >= 1).all()


def test_train_acceptance_labels_bos_blocks(bos_workdir, monkeypatch):
    from specdec.train.trainers import acceptance

    seen: dict = {}

    def fake_label_blocks(draft, target, blocks, *args, **kwargs):
        seen["blocks"] = blocks
        raise Stop

    monkeypatch.setattr(acceptance, "label_blocks", fake_label_blocks)
    with pytest.raises(Stop):
        # the target stands in for the draft: only the blocks are looked at
        acceptance.train_acceptance(bos_workdir / "target", bos_workdir / "target", [bos_workdir / "data.jsonl"],
                                    bos_workdir / "acceptance", tiny_cfg(seq_len=SEQ))
    assert_bos_blocks(blocks_of(seen["blocks"]), 1)


def test_dllm_examples_start_with_bos():
    from specdec.train.trainers.dllm import pair_examples, text_examples

    tok = bos_tokenizer()
    texts = corpus(60)
    examples = text_examples(tok, texts, SEQ, tok.eos_token_id)
    assert_bos_blocks(torch.tensor([ex.ids for ex in examples]), tok.bos_token_id)
    long_prompt = " ".join(texts[:6])  # longer than half a block: its end is kept, and its BOS
    pairs = pair_examples(tok, [(long_prompt, texts[7]), ("the cat", "sat.")], SEQ, tok.eos_token_id)
    assert all(ex.ids[0] == tok.bos_token_id and len(ex.ids) == SEQ and ex.prompt_len <= SEQ // 2 for ex in pairs)
    tail = tok(long_prompt, add_special_tokens=False)["input_ids"][-(SEQ // 2 - 1) :]
    assert pairs[0].ids[1 : SEQ // 2] == tail


def test_train_lm_blocks_start_with_bos():
    from specdec.train.trainers.lm import token_blocks

    tok = bos_tokenizer()
    texts = corpus(60)
    blocks = token_blocks(tok, list(range(len(texts))), SimpleNamespace(read=texts.__getitem__), SEQ)
    assert_bos_blocks(blocks.ids, tok.bos_token_id)
