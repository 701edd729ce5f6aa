#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest (real torchrun processes, real Slurm if up).
# `--fast`: the tier that launches no ranks (tests/conftest.py skips a test at its first launch), a few minutes.
source "$(dirname "$0")/env.sh"
echo "== ruff" && ruff check src tests examples benchmarks && ruff format --check src tests examples benchmarks
echo "== mypy" && mypy
echo "== pytest" && exec python -m pytest -q -p no:cacheprovider --durations=15 "$@"
