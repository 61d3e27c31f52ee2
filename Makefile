# keras-attn developer commands. Each target installs what it needs into .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Two pytest-xdist workers: much of a test's time is single-threaded tracing
# and compiling. `make test` on a 2-core machine:
# - AMD EPYC with AVX-512 BF16 and VNNI (no AMX), 2026-12-04, idle, from a
#   clean clone: at e2d9403 the TensorFlow run 12:29 (1,868 passed, 4
#   skipped) and the JAX run 2:56 (643 passed), 15:25 with the lint; at
#   eb4c5eb, later on the same machine, 15:52 (1,874 passed) and 3:54 (662
#   passed), 19:46 in all, then the TensorFlow run again in 14:18: the same
#   tests vary by a quarter there, so take the budget's margin as small.
#   At 21d46e8 (another host of that kind, idle): 13:12 (1,878 passed) and
#   2:57 (662 passed), 16:22 in all. At a8c5254 (the same kind, idle):
#   13:36 (1,881 passed) and 2:56 (662 passed), 16:43 in all; at 205ddb3,
#   whose exports no longer trace Keras's default signatures: 12:12 (1,882
#   passed) and 2:48 (662 passed), 15:11 in all. At e793c6c (the same
#   kind, idle, 2026-12-05): 12:48 (1,935 passed, 4 skipped) and 3:15 (666
#   passed), about 16:10 with the lint. At 191f5f6 (the same kind, idle,
#   the same day): 14:14 (1,976 passed, 4 skipped) and 3:06 (666 passed),
#   about 17:30 with the lint.
# - Intel Xeon with AMX (machine A), 2026-12-05, from a clean clone: at
#   126f659 inside `.ci/run` the TensorFlow run took 20:06 (2,005 passed,
#   4 skipped; a one-minute benchmark ran beside it) and JAX 3:25; at
#   432f96e, with three more tests marked `slow`, idle: 12:51 (2,000
#   passed, 4 skipped) and 3:09 (666 passed), 17:00 in all with the venv
#   and the lint. At 364fb6e (2026-12-06, idle): 10:20 (2,013 passed, 4
#   skipped) and 2:24 (666 passed), 13:34 in all.
#   The figures below are from before the `slow` marks of 0c54d59.
# - AMD EPYC (Zen 3) with AVX2 only (machine D), 2026-12-07, idle, at
#   538db97 from a clean clone: the TensorFlow run 28:28 (2,077 passed, 4
#   skipped; 3,348 worker-seconds) and the JAX run 6:53 (686 passed); in
#   .ci/run's other steps `test-slow` 29:38 (72 passed) and the JAX half of
#   `test-backends` 24:49 (747 passed, other jobs on the cores part of the
#   time). With the installs, `.ci/run` ran past its 90 minutes on a
#   machine of this speed; the changes after it (the servability check's
#   saved_model_cli summary read lazily, task functions traced without
#   AutoGraph, `quantize` collecting garbage once, half the property
#   examples on JAX, eight end-to-end runs of `test-slow` made `large`, two
#   of them `slow` again since) cut
#   that work, and
#   docs/experiments/2026-12-07-ci-budget.md measures them: at b17dda6 the
#   TensorFlow run took 26:55 (2,078 passed, 4 skipped; another job shared
#   the cores for about 5 minutes), still over the 20-minute budget here;
#   at 0d6b686 28:43 (idle), and CI's own run of .ci/run 85:06. At 83ad764,
#   which runs CI's TensorFlow and JAX tests in one session each (`make
#   test SCOPE=ci`), `.ci/run` from a clean clone took 59:30, idle: the
#   TensorFlow session (default and slow) 33:28, JAX 15:43, PyTorch 5:07;
#   but the host ran about 1.5 times as fast by then (`make test` at
#   ee077a8 from a clean clone, 08:49: TensorFlow 19:17 with 2,078 passed
#   and 4 skipped, JAX 4:27), and one session instead of two saved about a
#   tenth in a same-hour comparison (the experiment record).
# - Intel Xeon with AVX-512 and VNNI (no BF16, no AMX), 2026-12-04, 2 workers
#   while other work shared the cores: the TensorFlow run 25:24 (1,869
#   tests, 2,986 worker-seconds), the JAX run 19:37 (1,226 tests, 2,289)
#   before its task-level modules (about 750 worker-seconds) moved to
#   test-backends. Still over the budget here; the heaviest TensorFlow
#   modules are the docs' examples (212 s), the language model export (154),
#   streaming (137), quantization (129) and the translator export (120).
# - The same machine, 2026-12-03, after the
#   quantization and precision-export tests: the TensorFlow run 25:12 (1,815
#   tests; another job shared the cores for its first 10 minutes), the JAX
#   run 14:29 (1,068 tests, idle). Over the 20-minute budget here.
# - AMD EPYC with AVX2 only (no AVX-512), 2026-11-29: 27:37 in all (the
#   TensorFlow run 17:35, the JAX run 9:44). Before `worksteal`, the JAX
#   compile level (tests/conftest.py) and the last `slow` marks, the same
#   machine took 29:09 and 17:36 (docs/experiments/2026-11-29-test-budget.md).
# - AMD EPYC with AVX-512 BF16 (no AMX), 2026-11-28, before all of those and
#   the first `slow` marks: 26:17 (16:34 and 9:34); the same tests ran about
#   2.1 times as long on the AVX2 machine, so about 13-14 minutes there now
#   (not measured). test-torch 5:40.
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
# `worksteal` hands each worker a contiguous half of the tests, so a module's
# fixtures (trained models, exports) are mostly built once rather than once
# per worker (the export tests run about 20% faster than under `load`).
PYTEST_FLAGS ?= -q -n $(PYTEST_WORKERS) --dist worksteal
# The op, layer, decoding and memory tests run on every backend. `make test`
# runs all of them on TensorFlow and, on JAX, the ops and the two attention
# classes that replace Keras's (JAX_TESTS); `make
# test-backends` (whose JAX tests .ci/run runs in `make test SCOPE=ci`'s
# JAX run) runs the rest on JAX
# (the other layers, decoding and memory modules; the property tests, whose
# drawn shapes each compile; the task-level modules of JAX_MODEL_TESTS) and
# all of them on PyTorch, so CI covers the same tests on each backend.
BACKEND_TESTS := tests/ops tests/layers tests/generation tests/memory
JAX_TESTS := tests/ops tests/layers/test_multi_head_attention.py tests/layers/test_grouped_query_attention.py
JAX_MODEL_TESTS := tests/models/test_compiled_forward.py tests/models/test_generate_seeds.py tests/models/test_generate_samplers.py tests/models/test_dtype.py tests/models/test_quantize.py tests/models/test_language_model_positions.py tests/models/test_streaming.py tests/models/test_speculative_translation.py
TORCH_TESTS := $(BACKEND_TESTS) $(JAX_MODEL_TESTS) tests/property tests/models/test_torch_backend.py tests/benchmarks/test_long_attention_bench.py
# PyTorch's CPU build for Python 3.11 where the index offers one (pip takes
# a local wheel of this version first); elsewhere PyPI's build, which runs on
# the CPU too.
TORCH_VERSION ?= 2.13.0
TORCH_STAMP := $(VENV)/.installed-torch

.PHONY: help install lint test test-tf test-jax test-torch test-backends test-slow test-large bench bench-serving bench-decoding gpu-check-bundle demo check-serving check-package format clean

help:
	@echo "make demo        train, export and serve a small model (see README)"
	@echo "make test        lint + default tests (TensorFlow, then JAX backend)"
	@echo "make test-backends  what make test runs on TensorFlow only, on JAX and PyTorch (installs torch)"
	@echo "make test-slow   the end-to-end runs make test leaves to CI (marked slow)"
	@echo "make test-large  the slow tests (real corpora, long runs)"
	@echo "make bench       benchmarks/ (figures in BENCHMARKS.md)"
	@echo "make gpu-check-bundle  prepare .gpu_bundle/ for benchmarks/gpu_check.py on a GPU machine"
	@echo "make check-serving  check make demo's exports in the two newest TF Serving releases"
	@echo "make check-package  build the sdist and wheel; smoke-test them in fresh venvs"

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

# Minutes of training for each of the demo's two models.
DEMO_MINUTES ?= 3

demo: $(STAMP)
	$(PY) examples/demo.py --out artifacts/demo --minutes $(DEMO_MINUTES)

# The servability check of every export of `make demo` (the highest version of
# each model) in the runtime of the newest TF Serving release and the one
# before (keras_attn/export/releases.py; each runtime is a venv built on first
# use under ~/.cache/keras_attn/serving: a TensorFlow installation). Fails if any export is
# not servable; one that could not be fully verified (exit status 3, see
# docs/SERVING.md) is reported without failing.
DEMO_EXPORTS ?= artifacts/demo/export
SERVING_RELEASES ?= $(shell $(PY) -c "from keras_attn.export.releases import newest_releases; print(' '.join(r.version for r in newest_releases(2)))" 2>/dev/null)
check-serving: $(STAMP)
	@test -d $(DEMO_EXPORTS) || { echo "no $(DEMO_EXPORTS): run make demo first"; exit 1; }
	@test -n "$(SERVING_RELEASES)" || { echo "cannot read the release table"; exit 1; }
	@failed=0; for model in $(DEMO_EXPORTS)/*/; do for release in $(SERVING_RELEASES); do \
		echo "== $$model in TF Serving $$release"; \
		$(PY) -m keras_attn.export check $$model --serving-release $$release; status=$$?; \
		if [ $$status -eq 3 ]; then echo "NOT VERIFIED (not a failure): $$model in $$release"; \
		elif [ $$status -ne 0 ]; then failed=1; fi; \
	done; done; exit $$failed

test: lint test-tf test-jax

test-tf: $(STAMP)
	KERAS_BACKEND=tensorflow $(VENV)/bin/pytest $(PYTEST_FLAGS) $(TF_SELECTION)

# Keras's shipped MultiHeadAttention / GroupQueryAttention suites run on our
# classes in the TensorFlow run here, on JAX and PyTorch in test-backends.
test-jax: $(STAMP)
	KERAS_BACKEND=jax $(JAX_ENVIRONMENT) $(VENV)/bin/pytest $(PYTEST_FLAGS) $(JAX_SELECTION)

$(TORCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet 'torch==$(TORCH_VERSION)'
	@touch $(TORCH_STAMP)

test-torch: $(TORCH_STAMP)
	KERAS_BACKEND=torch $(VENV)/bin/pytest $(PYTEST_FLAGS) $(wildcard $(TORCH_TESTS))

# The JAX run draws a quarter of the property tests' examples (each drawn
# shape compiles there: about 1,400 worker-seconds of the run on a 2-core
# AVX2 machine at the full count, 720 at half, when CI ran past its 90
# minutes); the TensorFlow and PyTorch runs draw them all, and `make
# test-large` ten times as many on TensorFlow and JAX.
BACKEND_HYPOTHESIS_SCALE ?= 0.25
JAX_BACKEND_TESTS := $(filter-out $(JAX_TESTS),$(BACKEND_TESTS)) tests/property tests/models/test_torch_backend.py $(wildcard $(JAX_MODEL_TESTS))
test-backends: $(STAMP) test-torch
	KERAS_BACKEND=jax KERAS_ATTN_HYPOTHESIS_SCALE=$(BACKEND_HYPOTHESIS_SCALE) $(VENV)/bin/pytest $(PYTEST_FLAGS) $(JAX_BACKEND_TESTS) $(addprefix --ignore=,$(filter-out $(BACKEND_TESTS),$(JAX_TESTS)))

# `make test SCOPE=ci` (what .ci/run runs): the TensorFlow run as `make
# test`'s, and the JAX run with test-backends' JAX tests too (at
# BACKEND_HYPOTHESIS_SCALE; the JAX op tests' few hypothesis draws as well),
# in one session, so JAX starts its workers, imports and collects the suite
# once. The `slow` tests (`make test-slow`) are not in CI since e6ce069's
# run on machine D: with them its TensorFlow session was 53% through after
# 35 minutes, and CI at ae70bce ran past its 90 minutes (PyTorch's run cut
# at 27%). The default scope keeps setup.cfg's selection (neither `slow` nor
# `large`) and `make test`'s JAX tests.
SCOPE ?= default
ifeq ($(SCOPE),ci)
TF_SELECTION :=
JAX_ENVIRONMENT := KERAS_ATTN_HYPOTHESIS_SCALE=$(BACKEND_HYPOTHESIS_SCALE)
JAX_SELECTION := $(BACKEND_TESTS) $(filter-out $(BACKEND_TESTS),$(JAX_BACKEND_TESTS))
else ifeq ($(SCOPE),default)
TF_SELECTION :=
JAX_ENVIRONMENT :=
JAX_SELECTION := $(wildcard $(JAX_TESTS))
else
$(error SCOPE must be default or ci. Received: SCOPE=$(SCOPE))
endif

# End-to-end runs whose parts the default tests cover (marked `slow`: example
# scripts, served exports, the JAX import without TensorFlow, the
# distribution bench). Not in CI (SCOPE above): run it before landing a
# change to the scripts, the exports or the serving check.
test-slow: $(STAMP)
	KERAS_BACKEND=tensorflow $(VENV)/bin/pytest $(PYTEST_FLAGS) -m "slow and not large"

# The `large` tests, then the property tests with ten times their examples.
test-large: $(STAMP)
	KERAS_BACKEND=tensorflow $(VENV)/bin/pytest -q -m large  # one process: some start worker processes of their own
	KERAS_BACKEND=tensorflow KERAS_ATTN_HYPOTHESIS_PROFILE=large $(VENV)/bin/pytest $(PYTEST_FLAGS) tests/property
	KERAS_BACKEND=jax KERAS_ATTN_HYPOTHESIS_PROFILE=large $(VENV)/bin/pytest $(PYTEST_FLAGS) tests/property

# serving_bench.py builds small exports itself; with trained runs
# (--translator-run, --sentiment-run, --language-model-run) it serves those.
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

# What benchmarks/gpu_check.py needs on a GPU machine without TensorFlow or
# network (docs/GPU_CHECK.md): wheels and the pre-tokenized Ding pairs (GPL-2+:
# .gpu_bundle/ is ignored by git and never committed).
gpu-check-bundle: $(STAMP)
	$(PY) benchmarks/gpu_check_bundle.py --out .gpu_bundle

# The sdist and wheel as users get them: built with `python -m build`, checked
# (tests/package/check_dist.py), then installed into fresh virtual
# environments under $(CHECK_DIR): the wheel with only Keras and JAX (no
# TensorFlow) running tests/package/smoke_core.py on KERAS_BACKEND=jax, and
# the wheel with its `examples` extra running the sentiment script's smoke
# configuration. Both run outside the checkout, so they import the installed
# package. KERAS_VERSION=3.15.0 installs that Keras into the core environment
# (the ends of the declared range).
CHECK_DIR := build/check-package
KERAS_VERSION ?=
# build/lib goes too: setuptools copies the package there and puts all of
# build/lib in the wheel, so a module deleted from keras_attn/ (the server
# stand-in that moved to serving_standin/) would still be installed.
check-package: $(STAMP)
	rm -rf $(CHECK_DIR) build/lib
	mkdir -p $(CHECK_DIR)/run
	$(PY) -m build --sdist --wheel --outdir $(CHECK_DIR)/dist .
	$(PY) tests/package/check_dist.py $(CHECK_DIR)/dist
	$(PYTHON) -m venv $(CHECK_DIR)/core
	$(CHECK_DIR)/core/bin/python -m pip install --quiet --upgrade pip
	$(CHECK_DIR)/core/bin/python -m pip install --quiet $(CHECK_DIR)/dist/*.whl 'jax[cpu]' \
		$(if $(KERAS_VERSION),'keras==$(KERAS_VERSION)')
	cd $(CHECK_DIR)/run && KERAS_BACKEND=jax ../core/bin/python $(CURDIR)/tests/package/smoke_core.py
	$(PYTHON) -m venv $(CHECK_DIR)/examples
	$(CHECK_DIR)/examples/bin/python -m pip install --quiet --upgrade pip
	$(CHECK_DIR)/examples/bin/python -m pip install --quiet "$$(ls $(CHECK_DIR)/dist/*.whl)[examples]"
	cd $(CHECK_DIR)/run && KERAS_BACKEND=tensorflow ../examples/bin/python \
		$(CURDIR)/examples/sentiment.py --smoke --pretrained none --out sentiment
	test -f $(CHECK_DIR)/run/sentiment/metrics.json
	@echo "check-package: the sdist and wheel install and run"

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
