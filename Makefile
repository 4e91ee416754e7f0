# `make demo` and `make test` each create (or reuse) .venv in the checkout and
# install what they need, so they work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test matrix venv clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit("keras-mgpu needs Python 3.10+, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# The distribution-critical tests on the oldest and newest supported
# TensorFlow/Keras pairs (noxfile.py); NOX_ARGS="-s oldest" runs one.
matrix: $(STAMP)
	$(VENV)/bin/nox $(NOX_ARGS)

clean:
	rm -rf $(VENV) .nox build *.egg-info
