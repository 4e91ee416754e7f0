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

.PHONY: demo test matrix tensorboard wheel venv clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit("keras-mgpu needs Python 3.10+, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-%-$(ID): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$*]'
	rm -f $(VENV)/.installed-$*-*
	touch $@

venv: $(VENV)/.installed-test-$(ID)

demo: $(VENV)/.installed-demo-$(ID)
	$(PY) examples/demo.py $(DEMO_ARGS)

test: $(VENV)/.installed-test-$(ID)
	$(PY) -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# The distribution-critical tests on the oldest and newest supported
# TensorFlow/Keras pairs (noxfile.py); NOX_ARGS="-s oldest" runs one.
matrix: $(VENV)/.installed-test-$(ID)
	$(VENV)/bin/nox $(NOX_ARGS)

# The demo's logs (or LOGDIR=...), served on http://localhost:6006.
tensorboard: $(VENV)/.installed-demo-$(ID)
	$(VENV)/bin/tensorboard --logdir $(LOGDIR)

# A wheel in dist/, to install elsewhere: pip install dist/keras_mgpu-*.whl
wheel: | $(PY)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) .nox build dist *.egg-info
