#!/usr/bin/env bash
# The demo: a real 2-rank training run stopped part-way by its time budget, continued by a second launch,
# compared bit for bit with an uninterrupted run, then shown (status, ledger, report).
source "$(dirname "$0")/env.sh"
exec python examples/demo.py "$@"
