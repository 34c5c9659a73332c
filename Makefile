# `make demo` and `make test` work on a fresh machine from a clean clone: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench lock docs
setup: $(VENV)/.installed

# constraints.txt: the versions the tests passed with, so a fresh clone gets them (not next month's releases)
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0   # the CPU wheel on this machine; pyproject keeps torch>=2.5
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# Rewrite constraints.txt from what the venv holds now (after a deliberate upgrade that passed `make test`).
lock: setup
	{ grep '^#' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: setup
	$(PY) -m flows.demo

# Two pytest workers (pytest-xdist): one at a time, the integration tests used 0.79 of two cores (1462 CPU s in 1849 s:
# ranks wait on peers, servers, polls); two at once took them to 1531 s on two cores, every test passing.
# tests/conftest.py keeps an integration module on one worker and the network-namespace modules on one.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# tests/unit: the tests that start no training, server or network namespace; `make test` runs tests/integration too
# (every test there is marked slow, so `pytest -m "not slow"` picks the same tests).
test-fast: setup
	$(PY) -m pytest -q tests/unit

# The docs site (mkdocs.yml, docs/) into site/, strict: a broken link, anchor or reference fails the build.
# tests/unit/test_docs.py runs the same build into a temp dir. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(PY) bench/plan_quality.py
	$(PY) bench/solver_scale.py
	$(PY) bench/hetero_train.py
	$(PY) bench/predict_vs_measure.py
	$(PY) bench/overhead.py
	$(PY) bench/launch_start.py
	$(PY) bench/recovery.py
	$(PY) bench/checkpoint_cost.py
	$(PY) bench/gpu_step.py
	$(PY) bench/sailor_mit.py
