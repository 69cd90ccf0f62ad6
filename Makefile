# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install tools demo test lint bench clean schemas

install: $(STAMP)

# Rebuilt only when the packaging changes; code is installed editable.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# local CPU build of torch; a looser pin would pull gigabytes of CUDA packages
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,dev]'
	touch $@

demo: install
	$(BIN)/phasewise demo $(ARGS)

test: install tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# promtool (Debian's `prometheus` package) for the alert-rule tests; best effort:
# without root or apt the rule tests are skipped and say why.
tools:
	@command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; }; } ; } || \
	  echo "note: promtool not installed; alert-rule tests will be skipped"

lint: install
	$(BIN)/ruff check .

schemas: install
	$(BIN)/phasewise schemas --write infra/schemas

bench: install
	$(BIN)/phasewise bench pipeline --containers 200 --seconds 20 --json

clean:
	rm -rf $(VENV) build *.egg-info
