# Sourced by scripts/demo.sh and scripts/test.sh: make .venv with what torchrelay needs, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.torchrelay-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/scripts/constraints.txt" -nt "$STAMP" ]; then
  echo "setup: installing torchrelay and its dependencies into $VENV" >&2
  # exact dev builds from the constraints file (torch: the CPU wheel on disk); the package itself has lower bounds only
  "$VENV/bin/pip" install -q --disable-pip-version-check -c "$ROOT/scripts/constraints.txt" -e "$ROOT[dev]" 2>&1 \
    | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -c "import torch, torchrelay, matplotlib, pytest, transformers, accelerate" >/dev/null
  touch "$STAMP"
fi
# Bundle signatures (pack --sign, verify --allowed-signers) use OpenSSH's ssh-keygen; a fresh Debian CI machine
# (root) gets it here, elsewhere the signature tests say why they skip.
if ! command -v ssh-keygen >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing openssh-client (ssh-keygen, for bundle signatures)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq openssh-client >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq openssh-client >/dev/null 2>&1
  } || echo "setup: could not install openssh-client; the signature tests will skip" >&2
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
