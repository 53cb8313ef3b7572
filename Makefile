# Two entry points for a fresh machine; each does all of its own set-up in .venv.
#   make demo   install the runtime and run the embedded demo (no downloads of data or weights)
#   make test   install the test environment and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: demo test install install-test clean

$(VENV)/.runtime-installed: requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.runtime-installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

install: $(VENV)/.runtime-installed
install-test: $(VENV)/.test-installed

demo: $(VENV)/.runtime-installed
	$(PY) -m bam_surgery.surgery.demo --out demo-out

test: $(VENV)/.test-installed
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) demo-out *.egg-info
