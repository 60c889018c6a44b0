# Everything a new user or CI needs: `make demo` and `make test` create the venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export SPECDEC_HOME ?= $(HOME)/.cache/specdec

.PHONY: venv demo test test-fast bench docs clean

# pyproject.toml states ranges; constraints-cpu.txt pins the versions tested on a CPU machine
# (torch==2.13.0 makes pip take the CPU build on this machine's disk, not a CUDA build).
CONSTRAINTS ?= constraints-cpu.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[test,triton]"
	# speculators (tests load exports with its classes) declares transformers<=5.19; it runs under the pinned
	# 5.23, so it goes in without its declared dependencies (its import-time ones are in the test extra)
	$(BIN)/pip install --quiet --no-deps -c $(CONSTRAINTS) speculators
	touch $(STAMP)

venv: $(STAMP)

## Build the default model family if needed (once), then decode the shipped prompts.
demo: $(STAMP)
	mkdir -p out
	$(BIN)/specdec decode --in examples/prompts.jsonl --out out/demo.jsonl --overwrite --drafter ngram --batch-size 8
	@$(BIN)/python -c "import json; rows=[json.loads(l) for l in open('out/demo.jsonl')]; r=rows[0]; print('\n--- first record:', r['id']); print(r['completion'][:400])"

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
