"""The recipe's target pretraining (``train.trainers.lm.pretrain``) on the shared loop: a 3-step smoke run."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.train.trainers.lm import TokenBlocks, pretrain


def test_pretrain_three_steps_on_tiny_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    seq_len, batch = 16, 4
    g = torch.Generator().manual_seed(0)
    blocks = TokenBlocks(torch.randint(0, 64, (24, seq_len), generator=g, dtype=torch.int32))
    heldout = TokenBlocks(torch.randint(0, 64, (4, seq_len), generator=g, dtype=torch.int32))

    stats = pretrain(model, blocks, heldout, budget_s=60, lr=1e-3, batch_size=batch, seed=0, max_steps=3, progress=False)

    assert set(stats) == {"steps", "tokens_trained", "train_wall_s", "tokens_per_s", "final_train_loss", "loss_curve",
                          "stopped", "heldout_loss", "heldout_tokens"}
    assert stats["steps"] == 3 and stats["stopped"] == "steps"
    assert stats["tokens_trained"] == 3 * batch * seq_len
    assert stats["heldout_tokens"] == 4 * (seq_len - 1)  # every position but each block's first is predicted
    assert math.isfinite(stats["final_train_loss"]) and math.isfinite(stats["heldout_loss"])
