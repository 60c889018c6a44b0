"""What a trainer builds when the user names no draft vocabulary and no EAGLE layout."""

from __future__ import annotations

import json

from conftest import invoke
from specdec.tests.test_train import write_decode_output
from specdec.train.teacher import AUTO_DRAFT_VOCAB, LARGE_VOCAB, resolve_draft_vocab


def test_a_large_vocabulary_gets_a_reduced_draft_vocabulary_unless_told_otherwise():
    assert resolve_draft_vocab(None, 262144) == AUTO_DRAFT_VOCAB  # Gemma 3
    assert resolve_draft_vocab(None, LARGE_VOCAB - 1) is None  # a small vocabulary is drafted whole
    assert resolve_draft_vocab(None, 262144, possible=False) is None  # --init / --lora / --targets keep the draft's own
    assert resolve_draft_vocab(0, 262144) is None  # 0: the whole vocabulary
    assert resolve_draft_vocab(4096, 262144) == 4096


def test_eagle_heads_train_in_the_published_layout_by_default(tiny_family, tmp_path):
    write_decode_output(tmp_path / "data.jsonl", n=40)
    (tmp_path / "heads.yaml").write_text(
        "eagle:\n  steps: 2\n  batch: 2\n  seq_len: 32\n  warmup: 1\n  checkpoint_every: 0\n  heldout: 0.2\n  progress: false\n")
    args = ["train-heads", "--kind", "eagle", "--target", tiny_family / "target", "--data", tmp_path / "data.jsonl",
            "--recipe", tmp_path / "heads.yaml"]
    for extra, layout in (([], "eagle1"), (["--layout", "specdec"], None)):
        out = tmp_path / f"heads-{len(extra)}-{layout}"
        res = invoke([*args, *extra, "--out", out])
        assert res.exit_code == 0, res.output
        assert json.loads((out / "config.json").read_text()).get("layout") == layout
