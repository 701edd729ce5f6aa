# Sourced by scripts/demo.sh and scripts/test.sh: make .venv with what torchrelay needs, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.torchrelay-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "setup: installing torchrelay and its dependencies into $VENV" >&2
  # torch is pinned to the CPU wheel this workplace keeps on disk (a looser pin downloads a CUDA build)
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[dev]" 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -c "import torch, torchrelay, matplotlib, pytest" >/dev/null
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
