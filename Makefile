# Entry points for a fresh machine; each does all of its own set-up in .venv.
#   make demo       install the runtime and run the embedded demo (no downloads of data or weights)
#   make test       install the test environment and run the test suite
#   make reproduce  install the runtime and run the tiny pipeline (seed, specialists, mixtures, training,
#                   eval, report) on the repository's corpus into reproduce-out/; run again to resume
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q

REPRODUCE := reproduce-out

.PHONY: demo test reproduce install install-test clean

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

reproduce: $(VENV)/.runtime-installed
	$(PY) -m bam_surgery.surgery.cli pipeline tiny --out $(REPRODUCE) \
		$(if $(wildcard $(REPRODUCE)/pipeline.resolved.yaml),--resume)

clean:
	rm -rf $(VENV) demo-out $(REPRODUCE) *.egg-info
