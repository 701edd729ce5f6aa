#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest (real torchrun processes, real Slurm if up) on two
# workers.
# `--fast`: the tier of the tests with no tier marker (launch, slurm, full, s3: tests/conftest.py), a few minutes.
# `--floor`: in .venv-floor, on the lowest torch pyproject.toml declares (scripts/constraints-floor.txt): `--fast
# --floor` is the fast tier on torch 2.8. Building that venv downloads PyPI's torch 2.8 with its CUDA libraries
# (about 4.5 GB; 26 min on the shared VM, benchmarks/RESULTS.md), once.
args=()
for arg in "$@"; do
  if [ "$arg" = --floor ]; then export TORCHRELAY_FLOOR=1; else args+=("$arg"); fi
done
set -- ${args[@]+"${args[@]}"}
source "$(dirname "$0")/env.sh"
echo "== ruff" && ruff check src tests examples benchmarks && ruff format --check src tests examples benchmarks
echo "== mypy" && mypy
# Two workers, a file each at a time, then the timing-sensitive tests (marked `alone`) with nothing beside them
# (tests/conftest.py). Exit 5 (nothing selected, e.g. a file named that holds no `alone` test) counts as passing.
set +e  # both runs go on whatever the first says (env.sh set -e)
pytest_run() { python -m pytest -q -p no:cacheprovider "$@"; rc=$?; [ "$rc" -eq 5 ] && rc=0; return "$rc"; }
echo "== pytest (two workers)"
pytest_run -n 2 --dist loadfile --durations=15 -m "not alone" "$@"; first=$?
echo "== pytest (alone)"
pytest_run --durations=5 -m alone "$@"; second=$?
exit $(( first != 0 ? first : second ))
