# `make demo` and `make test` each create (or reuse) .venv in the checkout and
# install what they need, so they work on a fresh machine with Python 3.10+:
# the demo only its extra (keras-tuner, scikit-learn, tensorboard), the tests
# everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A stamp per extra, renewed when pyproject.toml changes.
ID := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
LOGDIR ?= runs/demo/logs

.PHONY: demo test test-all test-jax check typecheck matrix models tensorboard wheel venv docs clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit("keras-mgpu needs Python 3.10+, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)

# `dev` includes the other extras a target installs: its stamp stands for
# theirs (so `make docs` after `make venv` installs nothing).
INCLUDED_IN_dev := demo docs
$(VENV)/.installed-%-$(ID): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$*]'
	rm -f $(VENV)/.installed-$*-*
	touch $@ $(foreach extra,$(INCLUDED_IN_$*),$(VENV)/.installed-$(extra)-$(ID))

venv: $(VENV)/.installed-dev-$(ID)

demo: $(VENV)/.installed-demo-$(ID)
	$(PY) examples/demo.py $(DEMO_ARGS)

# The whole suite on Keras's TensorFlow backend and, beside it, the tests
# that run on either backend (tests/backends/, the models matrix's
# tests/models/) and JAX's own (tests/jax/) on the JAX backend, over 2
# forced host devices. Both run the matrix's CI models; `make models` runs
# them all. The suite's tests wait on child processes and signals, which
# leaves CPU idle: it runs on 3 pytest workers, and the JAX run, on one,
# beside it; the JAX output follows the suite's.
JAX_ENV := KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2
JAX_TESTS := tests/backends tests/models tests/jax
define SUITE_AND_JAX_BESIDE
	@jax_log=$$(mktemp); \
	$(JAX_ENV) $(PY) -m pytest -n 1 $(1) $(JAX_TESTS) >"$$jax_log" 2>&1 & \
	jax=$$!; \
	$(PY) -m pytest -n 3 --dist loadfile $(1) $(PYTEST_ARGS); suite=$$?; \
	wait $$jax; jax_status=$$?; \
	cat "$$jax_log"; rm -f "$$jax_log"; \
	[ $$suite -eq 0 ] && [ $$jax_status -eq 0 ]
endef
test: $(VENV)/.installed-dev-$(ID)
	$(call SUITE_AND_JAX_BESIDE,)

# `make test` with the exhaustive variants (pytest's `exhaustive` marker:
# more replica counts, optimizers, log levels and examples on the code
# paths the default run covers).
test-all: $(VENV)/.installed-dev-$(ID)
	$(call SUITE_AND_JAX_BESIDE,-m "not full_matrix")

# The JAX backend's run alone.
test-jax: $(VENV)/.installed-dev-$(ID)
	$(JAX_ENV) $(PY) -m pytest -n 2 --dist loadfile $(JAX_TESTS) $(PYTEST_ARGS)

# The fast tier: the type check (mypy), then the unit tests of the pieces
# that need no training run (the backup's store, lock and state, compat's
# checks and registry, the command line, strategy and cluster parsing, the
# import graph, the docstrings and the API reference, the file layer, the
# logger's records and sinks).
CHECK_TESTS := tests/test_backup_store.py tests/test_backup_lock.py \
	tests/test_callback_state.py tests/test_compat.py tests/test_cli.py \
	tests/test_strategy.py tests/test_collectives.py tests/test_imports.py \
	tests/test_docstrings.py tests/test_fs.py tests/test_sinks.py \
	tests/test_api_docs.py
check: typecheck
	$(PY) -m pytest -n 2 --dist loadfile -k "not end_to_end" $(CHECK_TESTS) $(PYTEST_ARGS)

# mypy over the package, with setup.cfg's [mypy] configuration.
typecheck: $(VENV)/.installed-dev-$(ID)
	$(VENV)/bin/mypy

# Every model of the tested-models matrix on both backends (noxfile.py's
# `models` session; about an hour on 2 cores).
models: $(VENV)/.installed-dev-$(ID)
	$(VENV)/bin/nox -s models

# The version-sensitive tests (noxfile.py's CRITICAL) on the oldest and
# newest supported TensorFlow/Keras pairs; NOX_ARGS="-s oldest" runs one.
matrix: $(VENV)/.installed-dev-$(ID)
	$(VENV)/bin/nox $(NOX_ARGS)

# The demo's logs (or LOGDIR=...), served on http://localhost:6006.
tensorboard: $(VENV)/.installed-demo-$(ID)
	$(VENV)/bin/tensorboard --logdir $(LOGDIR)

# The docs as a browsable site with search, the API reference included, in
# site/ (open site/index.html). Strict: a public name without a docstring
# or a broken link fails it.
docs: $(VENV)/.installed-docs-$(ID)
	$(VENV)/bin/mkdocs build --strict

# A wheel in dist/, to install elsewhere: pip install dist/keras_mgpu-*.whl
wheel: | $(PY)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) .nox build dist *.egg-info
