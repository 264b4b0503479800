# Two commands do all the set-up on a fresh machine with Python 3.10+ and pip:
#   make demo   - create .venv, install gradwatch, run the demo (examples/plain_loop.py)
#   make test   - create .venv, install gradwatch with its test dependencies, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.gradwatch-installed

.PHONY: demo test lint lightning-demo bench bench-quick clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/plain_loop.py

lightning-demo: $(STAMP)
	$(PY) examples/lightning_example.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check gradwatch tests tools benchmarks examples

bench-quick: $(STAMP)
	$(PY) benchmarks/overhead.py --quick

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
