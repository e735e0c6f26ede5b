#!/usr/bin/env bash
# `make test-slurm`: start a two-node Slurm on this machine (scripts/slurm_cluster.sh: two
# slurmd on this host), run the cross-node tests under srun -N2 and the real examples/slurm
# scripts under it, one job on both nodes (scripts/slurm_check.py), stop the daemons again.
# Where Slurm cannot be installed or started (not root, not Debian-like, no package), it says
# "test-slurm: SKIPPED: <why>" and exits 0; .ci/run reports the skip. Where only one node
# comes up, the one-node checks run and the two-node ones say SKIPPED, and why. Otherwise
# the status of the checks. SLURM_CHECK_TIMEOUT (seconds, default 1500) bounds the checks.
set -uo pipefail
cd "$(dirname "$0")/.."
export SLURM_CI_DIR=${SLURM_CI_DIR:-/tmp/pympar-slurm}
mkdir -p "$SLURM_CI_DIR"
status=0
scripts/slurm_cluster.sh up 2>"$SLURM_CI_DIR/up.err" || status=$?
if [[ $status == 3 ]]; then
  echo "test-slurm: SKIPPED: $(tail -n 1 "$SLURM_CI_DIR/up.err")"
  exit 0
elif [[ $status != 0 ]]; then
  cat "$SLURM_CI_DIR/up.err" >&2
  echo "test-slurm: FAILED: the Slurm did not start" >&2
  scripts/slurm_cluster.sh down || true
  exit "$status"
fi
trap 'scripts/slurm_cluster.sh down' EXIT
export SLURM_CONF=$SLURM_CI_DIR/etc/slurm.conf
# The jobs start from a clean environment of their own: nothing of an outer launcher.
unset $(env | grep -oE '^(PMI|PMIX|HYDRA|MPIR|OMPI)_[A-Za-z0-9_]*' || true)
status=0
timeout --kill-after=30 "${SLURM_CHECK_TIMEOUT:-1500}" .venv/bin/python scripts/slurm_check.py \
  || status=$?
if [[ $status == 0 && -f $SLURM_CI_DIR/one-node ]]; then
  echo "test-slurm: passed on one node; the two-node checks were SKIPPED: $(cat "$SLURM_CI_DIR/one-node")"
elif [[ $status == 0 ]]; then echo "test-slurm: passed (two nodes)"; else
  echo "test-slurm: FAILED (status $status; logs in out/slurm-check and $SLURM_CI_DIR/log)" >&2
fi
exit "$status"
