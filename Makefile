# Two commands set up a fresh machine:
#   make train   # installs into .venv, prepares the stdlib text data, trains recipes/tiny_dense.yaml on CPU
#   make test    # installs into .venv and runs the test suite (what .ci/run runs)
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
MCORE_SPEC  ?= megatron-core==0.19.2
RECIPE      ?= recipes/tiny_dense.yaml
NPROC       ?= 1
ARGS        ?=
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
DATA        := data/pystdlib_text_document.idx

SOAK_ARGS   ?= --repeats 2
PINS        := constraints.txt
PINS_VENV   ?= .venv-pins

.PHONY: install data train test test-matrix soak constraints clean

install: $(STAMP)

# Every package at the version constraints.txt pins (the versions the suite passed with); the check
# at the end stops the install naming any package that differs. Then megatron-core's C++ extension is
# built, and the checkout's modules compiled once (where PYTHONDONTWRITEBYTECODE is set, every fresh
# interpreter would compile them again).
$(STAMP): requirements.txt $(PINS) Makefile pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c $(PINS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(PINS) -r requirements.txt
	$(PY) -m pip install -q --no-deps --ignore-requires-python "$(MCORE_SPEC)"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) scripts/pins.py --check $(PINS)
	$(PY) -c "from megatron_ext import platform; platform.setup(); from megatron_ext.seams import extensions; extensions.build()"
	$(PY) -m compileall -q megatron_ext scripts train.py arguments.py
	touch $(STAMP)

# Refresh the pins: a fresh environment with the newest versions requirements.txt allows (torch and
# megatron-core as above), its versions written to constraints.txt. Then `make clean test` proves
# them (README, Tests).
constraints:
	rm -rf $(PINS_VENV)
	$(PYTHON) -m venv $(PINS_VENV)
	$(PINS_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(PINS_VENV)/bin/python -m pip install -q -r requirements.txt
	$(PINS_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python "$(MCORE_SPEC)"
	$(PINS_VENV)/bin/python scripts/pins.py --write $(PINS)
	rm -rf $(PINS_VENV)

data: $(DATA)

$(DATA): $(STAMP)
	$(PY) scripts/prepare_data.py --python-stdlib --output-prefix data/pystdlib

train: $(STAMP) $(DATA)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --nproc-per-node $(NPROC) train.py --recipe $(RECIPE) $(ARGS)

# the modules in the order tests/tiers.py gives (heaviest first), not xdist's (most tests first)
TEST_RUN    := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

test: $(STAMP) $(DATA)
	$(TEST_RUN) -m "not matrix"

# not part of `test`: the properties `test` proves, again on more architectures, layouts and
# compositions (tests/tiers.py MATRIX; docs/tests.md)
test-matrix: $(STAMP) $(DATA)
	$(TEST_RUN) -m matrix

# not part of `test`: the race-prone distributed cases repeated under CPU load, with SIGKILL/SIGTERM
# faults injected and the restarted runs' losses compared bit for bit (scripts/soak.py)
soak: $(STAMP) $(DATA)
	OMP_NUM_THREADS=1 $(PY) scripts/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) data
