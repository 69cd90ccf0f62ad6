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

# The suite runs in parallel processes, a test file per process at a time (files share module fixtures); the
# files that take minutes start first, in the order tests/conftest.py gives (FIRST), so none is left running alone
# at the end. Its tests burn CPU (roles, jobs, models) and wait (broker group joins, commits, image builds) by
# turns: on 2 cores, 4 processes left the CPU idle a fifth of the time, 6 a fifteenth, 8 slowed the longest tests
# more than they gained.
TEST_WORKERS ?= 6
# The sources are compiled first, as pip compiles an installed package: every role and CLI process a test starts
# (hundreds) then reads bytecode instead of compiling the modules it imports (0.17 CPU-s a role), also where
# PYTHONDONTWRITEBYTECODE keeps Python from writing it on its own. Likewise pytest's rewritten test modules, once
# (tests/rewrite_once.py), not once per process.
test: install tools
	$(BIN)/python -m compileall -q src
	$(BIN)/python tests/rewrite_once.py
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Test tools from Debian, best effort (root + apt): promtool (`prometheus`) for the
# alert-rule tests; dockerd (`docker.io`) and a static busybox (`busybox-static`) for the
# tests that manage real Docker containers. Without them those tests are skipped and say why.
APT_TOOLS := promtool:prometheus dockerd:docker.io busybox:busybox-static debootstrap:debootstrap
tools:
	@for t in $(APT_TOOLS); do cmd=$${t%%:*}; pkg=$${t#*:}; \
	  command -v $$cmd >/dev/null 2>&1 && continue; \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$pkg >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$pkg >/dev/null 2>&1; }; }; } || \
	  echo "note: $$pkg not installed; the tests that need $$cmd will be skipped"; \
	done

lint: install
	$(BIN)/ruff check .

# the JSON Schemas of the topics and the configuration reference, both written from the code
schemas: install
	$(BIN)/phasewise schemas --write infra/schemas
	$(BIN)/python -m phasewise.kit.settings > docs/configuration.md

bench: install
	$(BIN)/phasewise bench pipeline --containers 200 --seconds 20 --json

clean:
	rm -rf $(VENV) build *.egg-info
