# Two set-up commands (see README): `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit process e2e bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv
	$(UV) pip install --quiet --python $(PY) -e '.[dev]'
	touch $(STAMP)

# bubblewrap gives sandbox commands their own PID namespace; the tests skip namespace mode
# (with the reason) only where it truly cannot be installed.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) || \
	      echo "warning: could not install bubblewrap; sandboxes fall back to process groups"; \
	  else echo "note: bubblewrap not installed; sandboxes fall back to process groups"; fi; }

demo: $(STAMP) system-deps
	$(PY) -m cancellable_agents.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks example_dags
	$(VENV)/bin/ruff format --check src tests benchmarks example_dags

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: $(STAMP) system-deps lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit

process: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/process

e2e: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/e2e

bench: $(STAMP) system-deps
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
