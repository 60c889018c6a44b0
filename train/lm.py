"""Tokenizer and target LM of the embedded default family.

A byte-level BPE tokenizer and a small Llama-architecture target trained on the stdlib corpus
with accelerate (mixed precision ``auto``: bf16 autocast only where the hardware has it natively).
Saved with save_pretrained so that AutoModelForCausalLM / AutoTokenizer load the folder like any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
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
    """Byte-level BPE on (a deterministic slice of) the training files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        total = 0
        for path in corpus.train_files:
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


def token_blocks(tokenizer, files: list[Path], corpus: Corpus, seq_len: int, num_proc: int = 1):
    """A datasets.Dataset of fixed-length blocks: each file's tokens + EOS, concatenated and cut."""
    import datasets
    from datasets import Dataset

    datasets.disable_progress_bars()  # the recipe shows its own rich progress
    ds = Dataset.from_dict({"text": [corpus.read(p) for p in files]})
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        n = len(flat) // seq_len
        return {"input_ids": [flat[i * seq_len : (i + 1) * seq_len] for i in range(n)]}

    ds = ds.map(tokenize, batched=True, remove_columns=["text"], num_proc=num_proc)
    ds = ds.map(group, batched=True, batch_size=256, remove_columns=["ids"])
    return ds.with_format("torch")


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
def heldout_loss(model, blocks, batch_size: int = 8, max_blocks: int = 64) -> float:
    from specdec.train.loop import resolve_precision

    model.eval()
    losses = []
    n = min(len(blocks), max_blocks)
    bf16 = model.device.type == "cpu" and resolve_precision("auto") == "bf16"
    for i in range(0, n, batch_size):
        ids = blocks[i : min(i + batch_size, n)]["input_ids"].to(model.device)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, labels=ids)
        losses.append(out.loss.float().item())
    model.train()
    return sum(losses) / max(len(losses), 1)


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
) -> dict:
    """Next-token pretraining on ``run_training``: for ``max_steps`` steps, else for ``budget_s`` seconds
    with a cosine schedule that follows the clock. ``progress`` shows run_training's progress bar."""
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
        budget_minutes=0.0 if max_steps else budget_s / 60,
        clock_schedule=True,
        mixed_precision="auto",
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
        "heldout_loss": round(heldout_loss(res.model, heldout_blocks), 4),
    }


def save_target(model, tokenizer, out_dir: Path, metrics: dict, arch: TargetArch) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "training_config.json").write_text(json.dumps(asdict(arch), indent=2) + "\n")
