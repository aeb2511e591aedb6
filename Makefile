# titanlab: `make train` trains the debug model, `make test` runs the test suite.
# Both create .venv (when missing) and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for the CPU build of torch on machines without a CUDA GPU
# (e.g. --index-url of PyTorch's CPU wheel index; empty when a CPU wheel is found locally).
TORCH_CPU_PIP_ARGS ?=
CONFIG ?= train_configs/debug_model.toml
PYTEST_ARGS ?=
TESTS ?= tests
# The unit tests run on UNIT_WORKERS processes (pytest-xdist: they are independent and mostly
# single-process; --dist loadgroup keeps the tests marked `xdist_group("ledger")`, which share
# ledgers built once per process, in one worker). The integration tests run on INTEGRATION_WORKERS processes, a test module per
# worker (--dist loadscope keeps a module's shared fixtures in one process): each run uses 2-8
# ranks, but its start-up, rendezvous and single-process parts leave cores idle that a second
# module fills. Tests marked `serial` (a wall-clock bound, the Slurm cluster, the wheel's own
# environment) run one at a time in a pytest process of their own beside them: alone, after the
# integration tests, they left half of the 2 cores idle for 2.4 minutes (waiting on the Slurm
# daemons and the hung rank's timeout); their output is printed after the integration tests'.
UNIT_WORKERS ?= 2
# A command `make test` runs between the unit and the integration tests (.ci/run: install the
# llama.cpp wheel built beside the set-up and the unit tests, tools/ci_llama_cpp.sh).
BEFORE_INTEGRATION ?=
INTEGRATION_WORKERS ?= 2
# Coverage: off in `make test` (and so in CI): it measures only the pytest processes (the ranks,
# where the trainer runs, are workers it does not trace) and its tracer slowed the unit stage by
# ~15 % (~1 min of CI's 30). `make coverage` runs the same suite with it and prints the summary.
COV ?=
COV_QUIET = $(if $(COV),$(COV) --cov-report=)
# CI_REPORTS (set by .ci/run): each test stage's time goes to $(CI_REPORTS)/stages.tsv
# (tools/ci_stage.sh) and its JUnit file next to it, read by tools/ci_report.py at the end.
STAGE := tools/ci_stage.sh
JUNIT = $(if $(CI_REPORTS),--junitxml=$(CI_REPORTS)/$(1).xml)

.PHONY: train test coverage test-full test-full-part setup clean check lint format docs docs-serve benchmark test-parity-full gpu-check gpu-session llama-cpp llama-cpp-wheel peer-wheels dry-run-flavors

# Installs into .venv with uv when it can be had, else pip (tools/venv_install.sh: the same
# versions, ~20 s instead of ~3 min).
INSTALL = tools/venv_install.sh $(VENV)

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	@test -x $(PY) || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: CUDA GPU found, installing torch==$(TORCH_VERSION)"; \
		$(INSTALL) "torch==$(TORCH_VERSION)"; \
	else \
		echo "setup: no CUDA GPU, installing the CPU build of torch==$(TORCH_VERSION)"; \
		$(INSTALL) "torch==$(TORCH_VERSION)" $(TORCH_CPU_PIP_ARGS); \
	fi
	$(INSTALL) -e ".[dev]"
	@touch $@

train: setup
	./run_train.sh $(CONFIG)

test: setup
ifeq ($(TESTS),tests)
	$(STAGE) unit env OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs -n $(UNIT_WORKERS) --dist loadgroup $(COV_QUIET) $(call JUNIT,unit) $(PYTEST_ARGS) tests/unit
	$(BEFORE_INTEGRATION)
	@serial_log=$$(mktemp); \
	$(STAGE) "serial (overlapped)" env OMP_NUM_THREADS=1 COVERAGE_FILE=.coverage.serial $(PY) -m pytest -q -rs --durations=10 -m serial $(COV_QUIET) $(call JUNIT,serial) $(PYTEST_ARGS) tests/integration >"$$serial_log" 2>&1 & serial=$$!; \
	$(STAGE) integration env OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=10 -n $(INTEGRATION_WORKERS) --dist loadscope --no-loadscope-reorder -m "not serial" $(COV_QUIET) $(if $(COV),--cov-append) $(call JUNIT,integration) $(PYTEST_ARGS) tests/integration; status=$$?; \
	wait $$serial || status=1; \
	echo "---- the serial tests (beside the integration tests) ----"; cat "$$serial_log"; rm -f "$$serial_log"; \
	if [ -n "$(COV)" ] && [ -f .coverage.serial ]; then $(PY) -m coverage combine --append --quiet .coverage.serial && $(PY) -m coverage report --skip-covered; fi; \
	exit $$status
else
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=10 $(if $(COV),$(COV) --cov-report=term:skip-covered) $(PYTEST_ARGS) $(TESTS)
endif

# `make test` with coverage of the package (the pytest processes') and its summary at the end.
coverage:
	$(MAKE) test COV=--cov=titanlab

# llama-cpp-python (llama.cpp built from source, ~1.2 min on 2 cores), for the tests that run
# GGUF exports in llama.cpp (TITANLAB_LLAMA_CPP_TESTS=1; .ci/run does both). Portable x86-64
# kernels (GGML_NATIVE=OFF): the AMX int8 kernels a native build picks on some Xeons crashed in a
# sandbox here; the vision library (LLAVA_BUILD) is not needed, nor llama.cpp's common library
# (tools/llama_cpp_no_common.cmake: 2m32 -> 1m12, 256 -> 119 CPU-s, 2-core Xeon VM). -O1: the
# tests run tiny models, and the build takes 2m31 instead of 3m23 at llama.cpp's -O3 (measured
# with the common library on a 2-core AMD EPYC VM).
# `make llama-cpp-wheel` builds the wheel alone, with python3's own pip into LLAMA_CPP_WHEELS (no
# .venv needed: .ci/run starts it first, beside the single-threaded set-up, docs and lint);
# `make llama-cpp` installs that wheel when it is there, else builds it.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CPP_OPT ?= -O1
LLAMA_CPP_WHEELS ?= .llama-cpp-wheels
LLAMA_CPP_CMAKE = CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS_RELEASE=$(LLAMA_CPP_OPT) -DCMAKE_CXX_FLAGS_RELEASE=$(LLAMA_CPP_OPT) -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/tools/llama_cpp_no_common.cmake"
llama-cpp-wheel:
	$(LLAMA_CPP_CMAKE) python3 -m pip wheel -q --no-deps "llama-cpp-python==$(LLAMA_CPP_PYTHON)" -w $(LLAMA_CPP_WHEELS)
llama-cpp: setup
	$(LLAMA_CPP_CMAKE) $(PY) -m pip install -q --find-links $(LLAMA_CPP_WHEELS) "llama-cpp-python==$(LLAMA_CPP_PYTHON)"

# Quality gates: lint, format check and types (CI runs `make lint` before `make test`, which
# runs the unit tests with the rest); `make check` adds the unit tests alone, for a quick local run.
lint: setup
	$(PY) -m ruff check titanlab tools tests setup.py
	$(PY) -m ruff format --check titanlab tools tests setup.py
	$(PY) -m mypy

check: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n $(UNIT_WORKERS) tests/unit

format: setup
	$(PY) -m ruff check --fix titanlab tools tests setup.py
	$(PY) -m ruff format titanlab tools tests setup.py

# The documentation site (mkdocs.yml, pages in docs/, the API reference from the docstrings):
# installs docs/requirements.txt into the venv when missing (or changed), then builds it with
# --strict into site/ (git-ignored), so a broken link, anchor or API reference fails. CI runs it
# after `make lint`; about 10 s on 2 cores once installed.
DOCS_INSTALLED := $(VENV)/.docs-installed
docs: setup $(DOCS_INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

$(DOCS_INSTALLED): docs/requirements.txt
	$(INSTALL) -r docs/requirements.txt
	@touch $@

# The built site served on http://localhost:$(DOCS_PORT): its search reads an index the browser
# will not load from a page opened from disk (file://), so search works only when served.
DOCS_PORT ?= 8000
docs-serve: docs
	$(PY) -m http.server --directory site --bind 127.0.0.1 $(DOCS_PORT)

# The CPU quick benchmark matrix (tools/benchmark.py), written to docs/performance.md.
benchmark: setup
	OMP_NUM_THREADS=1 $(PY) tools/benchmark.py --matrix quick

# The layout planner's pick for every published flavor at its real world size, each dry-run on
# fake process groups (docs/dry_run.md; CI dry-runs the recorded picks). ~10 min on 2 cores.
dry-run-flavors: setup
	OMP_NUM_THREADS=1 $(PY) tools/dry_run_flavors.py

# Every valid layout of 1, 2, 4, 8 ranks against 1 process (the table goes to
# docs/parallelism.md), then every MoE balancing × layout case (expert parallel included) and
# the compile, profiler-trace and option cases CI leaves out (context parallel's included), and
# the feature-pair matrix with a row for every supported pair (CI runs its covering rows).
test-parity-full: setup
	OMP_NUM_THREADS=1 $(PY) tools/parity_matrix.py
	OMP_NUM_THREADS=1 TITANLAB_PARITY_FULL=1 $(PY) -m pytest -q -rs tests/integration/test_qwen3_moe.py tests/integration/test_gpt_oss.py tests/integration/test_qwen3_5.py tests/integration/test_compile.py tests/integration/test_muon_training.py tests/integration/test_profiling_traces.py tests/integration/test_document_mask_parity.py tests/integration/test_cp_documents.py "tests/integration/test_parallel_parity.py::test_option_matches_single_process" "tests/integration/test_lora.py::test_more_layouts_equal_one_process" "tests/integration/test_lora.py::test_fsdp2_with_selective_and_full_ac_equals_one_process" tests/integration/test_chat_sft.py "tests/integration/test_distill.py::test_distillation_under_a_layout_equals_one_process" "tests/integration/test_qlora_training.py::test_at_8k_under_fsdp2_with_full_ac_nf4_trains_like_bf16_lora_in_a_quarter_of_the_bytes" "tests/integration/test_qlora_training.py::test_more_layouts_equal_fsdp2" tests/integration/test_feature_pairs.py tests/unit/distributed/tensor_parallel/test_two_d.py tests/unit/distributed/tensor_parallel/test_three_d.py tests/unit/distributed/tensor_parallel/test_grid_dp.py

# Everything CI leaves out, in one target: the whole suite with TITANLAB_PARITY_FULL=1 (every
# case CI trims to a pairwise cover or leaves to the full matrices: all MoE, RL, LoRA, QLoRA,
# compile, CP-document and feature-pair triple cases, 2.5D/3D TP) and the GGUF and Slurm tests,
# then every valid layout of 1-8 ranks (tools/parity_matrix.py) and every published flavor's
# planner pick dry-run at its real size (tools/dry_run_flavors.py); both rewrite their tables
# in docs/. Hours on 2 cores.
# make test-full in parts: PART=k/n runs part k of n of its pytest stages (the test modules,
# tests/full_parts.py: each module in exactly one part), of the parity matrix's layouts and of
# the flavors' dry runs (by name, tools/lib/parts.py), so that the whole can be run across
# sessions of a few hours. The parity matrix records each layout with its commit in
# docs/parity_matrix.jsonl and skips the layouts recorded while the training code is unchanged.
test-full-part: setup llama-cpp
	@test -n "$(PART)" || { echo "make test-full-part: give PART=k/n, e.g. PART=1/4"; exit 2; }
	TITANLAB_FULL_PART=$(PART) TITANLAB_PARITY_FULL=1 TITANLAB_SLURM_TESTS=1 TITANLAB_LLAMA_CPP_TESTS=1 $(MAKE) test PYTEST_ARGS="-p tests.full_parts $(PYTEST_ARGS)"
	OMP_NUM_THREADS=1 $(PY) tools/parity_matrix.py --part $(PART)
	OMP_NUM_THREADS=1 $(PY) tools/dry_run_flavors.py --part $(PART)

test-full: setup llama-cpp
	TITANLAB_PARITY_FULL=1 TITANLAB_SLURM_TESTS=1 TITANLAB_LLAMA_CPP_TESTS=1 $(MAKE) test
	OMP_NUM_THREADS=1 $(PY) tools/parity_matrix.py
	OMP_NUM_THREADS=1 $(PY) tools/dry_run_flavors.py

# On a machine with a CUDA GPU: every GPU test (`pytest -m gpu`), then the 8B-shaped benchmark
# rows, into docs/gpu_check.md and the gpu-check block of docs/performance.md
# (tools/gpu_check.py). It uses the machine's own torch and installs nothing; GPU_PYTHON chooses
# the interpreter (default: .venv's when present, else python3).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# A lent GPU machine's short session (tools/gpu_session.sh): the torchtitan A/B, fine-tuning
# against transformers + peft (+ Liger), the plain loop, the Muon and document-mask rows, in
# order of value under DEADLINE_S seconds, each stage's results into OUT as it finishes.
gpu-session:
	bash tools/gpu_session.sh

# The wheels a GPU machine without a network needs (torchtitan 0.2.2 for
# tools/benchmark_torchtitan.py, torchdata, torchao, tomli) into .whl/ (tools/peer_wheels.sh).
peer-wheels:
	bash tools/peer_wheels.sh .whl

clean:
	rm -rf $(VENV) outputs .pytest_cache site
