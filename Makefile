# keras-attn developer commands. Each target installs what it needs into .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_FLAGS ?= -q
# Op, layer, decoding and memory tests run a second time on the JAX backend.
JAX_TESTS := tests/ops tests/layers tests/generation tests/memory

.PHONY: help install lint test test-tf test-jax test-large bench bench-serving bench-decoding demo format clean

help:
	@echo "make demo        train, export and serve a small model (see README)"
	@echo "make test        lint + default tests (TensorFlow, then JAX backend)"
	@echo "make test-large  the slow tests (real corpora, long runs)"
	@echo "make bench       benchmarks/ (figures in BENCHMARKS.md)"

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; run make PYTHON=python3"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: $(STAMP)
	$(PY) examples/demo.py --out artifacts/demo

test: lint test-tf test-jax

test-tf: $(STAMP)
	KERAS_BACKEND=tensorflow $(VENV)/bin/pytest $(PYTEST_FLAGS)

test-jax: $(STAMP)
	KERAS_BACKEND=jax $(VENV)/bin/pytest $(PYTEST_FLAGS) $(wildcard $(JAX_TESTS))

test-large: $(STAMP)
	KERAS_BACKEND=tensorflow $(VENV)/bin/pytest $(PYTEST_FLAGS) -m large

# serving_bench.py needs trained runs (runs/transformer, runs/sentiment): make bench-serving
bench: $(STAMP)
	@for script in attention blocks generation pipeline training pretrained; do \
		echo "== benchmarks/$${script}_bench.py"; $(PY) benchmarks/$${script}_bench.py || exit 1; \
	done

bench-serving: $(STAMP)
	$(PY) benchmarks/serving_bench.py

# decoding_bench.py needs a trained translator run (RUN=runs/transformer)
RUN ?= runs/transformer
bench-decoding: $(STAMP)
	$(PY) benchmarks/decoding_bench.py --run $(RUN)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
