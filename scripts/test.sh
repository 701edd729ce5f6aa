#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest (real torchrun processes, real Slurm if up).
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
echo "== pytest" && exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
