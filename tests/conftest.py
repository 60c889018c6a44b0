"""Tiny random-init models built in seconds; float64 so greedy comparisons are exact."""

from __future__ import annotations

import os
import shutil

# Triton kernels read TRITON_INTERPRET when their module is imported, possibly while another test
# module is collected: set it before anything imports them (CPU machines only run the interpreter).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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



@pytest.fixture(autouse=True)
def _threads_of_its_own():
    """Each test starts without a load-following thread governor left by an earlier one (a decode's
    ``--threads 0``): left behind, it re-reads the machine's load between rounds and changes torch's
    thread count, and so the order of float reductions, in the middle of another test's comparison."""
    import torch

    from specdec.models import threads

    before = torch.get_num_threads()
    threads.fix(before)
    yield
    threads.fix(before)

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


def staggered_requests(seed: int = 11):
    """Six requests whose prompts (3..40 tokens) and budgets differ: rows of one batch are left-padded
    and finish at different times."""
    from specdec.decode.engine.types import GenRequest

    prompts = make_prompts(6, seed=seed, lo=3, hi=40)
    return [GenRequest(p, n) for p, n in zip(prompts, [24, 7, 31, 12, 18, 3])]


def tiny_tokenizer(path=None):
    """A real byte-level BPE (vocab ~300) trained in well under a second on a few lines of Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [
        "def add(a, b):\n    return a + b\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for i in range(10):\n    print(i * i)\n",
        "import os\nimport sys\npath = os.path.join('a', 'b')\n",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
    if path is not None:
        fast.save_pretrained(path)
    return fast


def save_tiny_lm(path, tokenizer, seed=0, layers=2, hidden=48, max_pos=256):
    """A random-init Llama with the tokenizer's vocabulary, saved as safetensors (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """A saved target + draft pair (and an unrelated-tokenizer draft) in a temporary SPECDEC_HOME."""
    root = tmp_path_factory.mktemp("family")
    tok = tiny_tokenizer()
    save_tiny_lm(root / "target", tok, seed=0)
    save_tiny_lm(root / "draft", tok, seed=1, layers=1, hidden=32)
    other = tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    save_tiny_lm(root / "foreign-draft", other, seed=2, layers=1, hidden=32)
    return root


class CliResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str):
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr
        self.output = stdout + stderr


def invoke(args) -> CliResult:
    """Run the ``specdec`` CLI in-process through its error boundary (``cli.main.run``), as a user's shell would."""
    import contextlib
    import io

    from specdec.cli.main import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped (not failed) where none is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
