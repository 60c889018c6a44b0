"""Tokenizer and target LM of a recipe's family.

A byte-level BPE tokenizer and a small Llama-architecture target trained on the recipe's corpus
with accelerate, in the recipe's mixed precision (``auto``: bf16 autocast only where the hardware has it
natively).
Saved with save_pretrained so that AutoModelForCausalLM / AutoTokenizer load the folder like any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.train.corpus import Corpus

EOS = "<|endoftext|>"
PAD = "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


@dataclass
class TargetArch:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


def train_tokenizer(corpus: Corpus, out_dir: Path, vocab_size: int = 4096, max_bytes: int = 6_000_000):
    """Byte-level BPE on a deterministic, spread-out sample of the training files (in content-hash
    order, so no one package or folder fills the sample)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        total = 0
        for path in sorted(corpus.train_files, key=lambda p: corpus.sha256.get(p, str(p))):
            text = corpus.read(path)
            total += len(text)
            yield text
            if total > max_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


class TokenBlocks:
    """Fixed-length blocks of token ids as a map-style dataset: item i is {"input_ids": [seq_len]},
    a slice is a batch {"input_ids": [n, seq_len]}."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # [n, seq_len], int32 (a vocabulary below 2**31; half the memory of int64)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i].long()}


def encode_texts(tokenizer, texts, chunk: int = 512) -> torch.Tensor:
    """Every text's tokens followed by EOS, concatenated (int32). The Rust tokenizer encodes each chunk
    of texts on all cores; ``texts`` may be a generator, so only one chunk is held as strings."""
    import itertools

    import numpy as np

    backend, eos = tokenizer.backend_tokenizer, tokenizer.eos_token_id
    parts = []
    texts = iter(texts)
    while batch := list(itertools.islice(texts, chunk)):
        for enc in backend.encode_batch_fast(batch, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.int32))
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int32)


def token_blocks(tokenizer, files: list[Path], corpus: Corpus, seq_len: int) -> TokenBlocks:
    """Each file's tokens + EOS, concatenated and cut into blocks of ``seq_len`` as every trainer's are
    (``train.data.cut_blocks``; this family's tokenizer puts nothing in front of a prompt)."""
    from specdec.train.data import block_prefix, cut_blocks

    ids = encode_texts(tokenizer, (corpus.read(p) for p in files))
    return TokenBlocks(cut_blocks(ids, seq_len, block_prefix(tokenizer)))


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """[vocab] UTF-8 bytes each token stands for (special tokens: 0). In a byte-level BPE vocabulary
    every character of a token names one byte, so a text's tokens add up to its UTF-8 length."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = set(ByteLevel.alphabet())
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    lengths = torch.zeros(len(tokenizer), dtype=torch.long)
    for token, idx in tokenizer.get_vocab().items():
        if token in special:
            continue
        if not set(token) <= alphabet:
            raise ValueError(f"token {token!r} is not byte-level BPE: its bytes cannot be counted")
        lengths[idx] = len(token)
    return lengths


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """Total held-out loss in nats over the UTF-8 bytes of the text it scored, in bits: comparable
    across tokenizers, unlike nats per token."""
    return nats / (n_bytes * math.log(2))


def build_model(arch: TargetArch, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **asdict(arch) | {"vocab_size": len(tokenizer)},
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def heldout_metrics(model, blocks, byte_lengths: torch.Tensor | None = None, batch_size: int = 8,
                    max_blocks: int = 64, mixed_precision: str = "auto") -> dict:
    """Held-out loss over the first ``max_blocks`` blocks: nats per predicted token and, given the
    tokens' byte lengths, bits per byte of the same predicted tokens' text."""
    import torch.nn.functional as F

    from specdec.train.loop import resolve_precision

    model.eval()
    n = min(len(blocks), max_blocks)
    bf16 = resolve_precision(mixed_precision) == "bf16"
    if byte_lengths is not None:
        byte_lengths = byte_lengths.to(model.device)
    nats, tokens, n_bytes = 0.0, 0, 0
    for i in range(0, n, batch_size):
        ids = blocks[i : min(i + batch_size, n)]["input_ids"].to(model.device)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits
        labels = ids[:, 1:]
        nats += float(F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), reduction="sum"))
        tokens += labels.numel()
        if byte_lengths is not None:
            n_bytes += int(byte_lengths[labels].sum())
    model.train()
    out = {"heldout_loss": round(nats / max(tokens, 1), 4), "heldout_tokens": tokens}
    if byte_lengths is not None:
        out |= {"heldout_bits_per_byte": round(bits_per_byte(nats, n_bytes), 4), "heldout_bytes": n_bytes}
    return out


def pretrain(
    model,
    train_blocks,
    heldout_blocks,
    budget_s: float,
    lr: float = 3e-3,
    batch_size: int = 16,
    seed: int = 0,
    max_steps: int | None = None,
    progress: bool = True,
    mixed_precision: str = "auto",
    byte_lengths: torch.Tensor | None = None,
    eval_blocks: int = 64,
) -> dict:
    """Next-token pretraining on ``run_training``: for ``max_steps`` steps, else for ``budget_s`` seconds
    with a cosine schedule that follows the clock (``max_steps`` and a budget: the steps, unless the
    budget runs out first). ``progress`` shows run_training's progress bar. Held-out metrics come from
    ``heldout_metrics`` over ``eval_blocks`` blocks."""
    import tempfile

    from specdec.train.loop import TrainConfig, run_training

    seq_len = len(train_blocks[0]["input_ids"])
    cfg = TrainConfig(
        lr=lr,
        steps=max_steps or 10**9,  # budget-only: the clock is what stops the run
        batch=batch_size,
        seq_len=seq_len,
        warmup=50,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        clip=1.0,
        seed=seed,
        checkpoint_every=0,
        save_final_checkpoint=False,  # the recipe saves the model itself; optimizer state is not needed
        budget_minutes=budget_s / 60,
        clock_schedule=not max_steps,  # fixed steps: the cosine follows the steps, the same on any hardware
        mixed_precision=mixed_precision,
        log_every=25,
        progress=progress,
    )

    def loss_fn(model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    with tempfile.TemporaryDirectory() as scratch:  # nothing is written there (no checkpoints)
        res = run_training(cfg, model, loss_fn, train_blocks, scratch, label="target")
    tokens = res.steps * batch_size * seq_len * res.accelerator.num_processes
    curve = [(s, round(loss, 4)) for s, loss in enumerate(res.losses, 1) if s % 25 == 0]
    return {
        "steps": res.steps,
        "tokens_trained": tokens,
        "train_wall_s": round(res.wall_s, 1),
        "tokens_per_s": round(tokens / max(res.wall_s, 1e-6)),
        "final_train_loss": round(res.losses[-1], 4) if res.losses else None,
        "loss_curve": curve,
        "stopped": res.stopped,
        **heldout_metrics(res.model, heldout_blocks, byte_lengths, max_blocks=eval_blocks, mixed_precision=mixed_precision),
    }


def save_target(model, tokenizer, out_dir: Path, metrics: dict, arch: TargetArch) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "training_config.json").write_text(json.dumps(asdict(arch), indent=2) + "\n")
