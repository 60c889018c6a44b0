"""Tiny random-init models built in seconds; float64 so greedy comparisons are exact."""

from __future__ import annotations

import pytest
import torch


def tiny_llama(vocab: int = 96, hidden: int = 48, layers: int = 3, seed: int = 0, heads: int = 4, kv_heads: int = 2, max_pos: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).double().eval()
    # sharpen the random logits so greedy text is not uniform noise
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


class ByteTokenizer:
    """Minimal tokenizer stand-in for engine tests (decode only)."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_llama(seed=1, layers=1, hidden=32)


def make_prompts(n: int, vocab: int = 96, seed: int = 0, lo: int = 5, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        # repeated motifs so n-gram drafters find matches
        motif = torch.randint(3, vocab, (4,), generator=g).tolist()
        body = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(body[: length // 2] + motif + body[length // 2 :] + motif)
    return out
