"""llama.cpp as a bench peer (``llamacpp``, ``llamacpp-lookup``): the same GGUF file, prompts and token
budget, through ``llama-cpp-python`` (the optional extra ``specdec[peers]``).

llama.cpp computes with the file's quantised weights and 8-bit activations, so its greedy text may differ
from the model's float32 greedy text that specdec reproduces; the report's ``identical_to_ar`` and
``token_agreement`` say by how much. ``llamacpp-lookup`` is llama-cpp-python's prompt-lookup drafting.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdec.models.errors import SpecdecError, UsageError

PEERS = ("llamacpp", "llamacpp-lookup")
LOOKUP_TOKENS = 10  # prompt-lookup draft length, as hf-lookup's


def is_llamacpp(spec: str) -> bool:
    return spec.split("+", 1)[0] in PEERS


def check_installed(spec: str) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise UsageError(f"{spec} needs llama-cpp-python: pip install 'specdec[peers]' (it builds llama.cpp from source, "
                         "several minutes)")


# what the probe's child runs: load the file and decode two tokens, as a bench pass does
PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
for i, _ in enumerate(llm.generate([llm.token_bos()], temp=0.0, top_k=1, reset=True)):
    if i == 1:
        break
"""
# a build of llama.cpp for the CPU it was built on (GGML_NATIVE) can use AMX tiles, which a virtual machine may
# not allow: its first matrix product then dies of a protection fault
REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF '
           '-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python')


def probe(spec: str, path: Path, threads: int = 1, timeout: float = 300) -> None:
    """llama.cpp decodes two tokens of ``path`` in a child process: a build that crashes on this machine
    would otherwise take the whole bench down with it, every method measured before it lost. A
    ``SpecdecError`` (one line, naming the signal and a rebuild) where the child dies."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(path), str(max(1, threads))], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SpecdecError(f"{spec}: llama.cpp did not decode two tokens of {path.name} in {timeout:.0f} s") from None
    if done.returncode == 0:
        return
    if done.returncode < 0:
        try:
            what = signal.Signals(-done.returncode).name
        except ValueError:
            what = f"signal {-done.returncode}"
        raise SpecdecError(f"{spec}: llama.cpp crashed ({what}) decoding {path.name} on this machine; its build does not "
                           f"run on this CPU (on a virtual machine, often AMX instructions it does not allow): rebuild it "
                           f"without them, e.g. {REBUILD}")
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    raise SpecdecError(f"{spec}: llama.cpp failed decoding {path.name} (exit {done.returncode}): {last}")


def gguf_file(source: str, spec: str) -> Path:
    """The GGUF file a converted target folder came from; a ``UsageError`` for a target that is not one."""
    from specdec.models import gguf as gg

    folder = Path(source)
    path = gg.source_file(folder)
    if path is not None:
        return path
    if (folder / gg.MARKER).is_file():
        raise UsageError(f"{spec}: the GGUF file {source} was converted from is no longer where it was")
    raise UsageError(f"{spec} runs GGUF targets only (--target FILE.gguf or the default model); {source} is not one")


def prepare(spec: str, source: str, prompts: list[list[int]], options, eos_ids: set[int], threads: int, warmup: int):
    """A runner (lo, hi) -> [(tokens, stats)] decoding the prompts one at a time with llama.cpp, greedy
    (temperature 0) or at the options' temperature."""
    check_installed(spec)
    from llama_cpp import Llama

    name = spec.split("+", 1)[0]
    kwargs = {}
    if name == "llamacpp-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    longest = max(map(len, prompts)) + options.sampling.max_new_tokens + 16
    llm = Llama(model_path=str(gguf_file(source, spec)), n_ctx=max(512, longest), n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, seed=options.sampling.seed or 0, **kwargs)
    eos = set(eos_ids) | {llm.token_eos()}
    temperature = options.sampling.temperature

    def one(prompt: list[int], n: int) -> list[int]:
        out = []
        llm.reset()
        for token in llm.generate(prompt, temp=temperature, top_k=0 if temperature > 0 else 1, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= n:
                break
        return out

    for p in prompts[:warmup]:
        one(p, 16)

    def decode(lo: int, hi: int) -> list:
        rows = []
        for i in range(lo, hi):
            t0 = time.perf_counter()
            toks = one(prompts[i], options.sampling.max_new_tokens)
            rows.append((toks, {"new_tokens": len(toks), "wall_s": time.perf_counter() - t0}))
        return rows

    return decode
