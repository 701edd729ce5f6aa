# Sourced by scripts/demo.sh and scripts/test.sh: make .venv with what torchrelay needs, once.
# TORCHRELAY_FLOOR=1 (scripts/test.sh --floor): .venv-floor instead, with the lowest torch the package declares
# (scripts/constraints-floor.txt); TORCHRELAY_VENV=DIR: that venv instead of either (made there if missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${TORCHRELAY_FLOOR:-0}" = 1 ]; then
  VENV="${TORCHRELAY_VENV:-$ROOT/.venv-floor}"
  CONSTRAINTS="$ROOT/scripts/constraints-floor.txt"
else
  VENV="${TORCHRELAY_VENV:-$ROOT/.venv}"
  CONSTRAINTS="$ROOT/scripts/constraints.txt"
fi
STAMP="$VENV/.torchrelay-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$CONSTRAINTS" -nt "$STAMP" ]; then
  echo "setup: installing torchrelay and its dependencies into $VENV" >&2
  # exact dev builds from the constraints file (torch: the CPU wheel on disk); the package itself has lower bounds only
  # DS_BUILD_OPS=0: deepspeed's sdist builds a pure-Python wheel (measured: 37 s on the shared 2-core VM at load 10)
  DS_BUILD_OPS=0 "$VENV/bin/pip" install -q --disable-pip-version-check -c "$CONSTRAINTS" \
    -e "$ROOT[dev]" 2>&1 | grep -v "is ignored" >&2 || true
  # torchtitan without its dependencies (datasets, wandb, tensorboard...: its trainer's, not its checkpointer's)
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps torchtitan==0.3.0 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -c "import torch, torchrelay, matplotlib, pytest, transformers, deepspeed, accelerate" >/dev/null
  touch "$STAMP"
  FRESH=1
fi
# The ops live in torch's extension cache (~/.cache/torch_extensions), not in the venv: a machine whose cache is new
# and whose venv was made before (a shared or restored venv, its stamp present) would compile both inside the suite,
# in the first test that needs each (the run of 2026-12-02 17:06-18:00: deepspeed_shm_comm in tests/test_deepspeed.py,
# DeepSpeedCPUAdam for 424 s in tests/test_four_ranks.py at load 5-9). So they are checked on every call, apart; past the
# venv's installation, only where a compiler is there to build them (without one, their tests skip).
EXT_ROOT="${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_extensions/py*}"
ops_built() {  # a glob: TORCH_EXTENSIONS_DIR is the folder itself, the default has a py<version>_<accelerator> level
  compgen -G "$EXT_ROOT/deepspeed_shm_comm/deepspeed_shm_comm.so" >/dev/null &&
    compgen -G "$EXT_ROOT/cpu_adam/cpu_adam.so" >/dev/null
}
if ! ops_built && { [ "${FRESH:-0}" = 1 ] || command -v g++ >/dev/null 2>&1; }; then
  # DeepSpeed's CPU accelerator compiles its shared-memory collectives (deepspeed_shm_comm, C++ with g++ and ninja)
  # when a process group first starts, into ~/.cache/torch_extensions: done once here, so no test waits for it.
  if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing g++ (DeepSpeed compiles its CPU collectives)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq g++ >/dev/null 2>&1 || {
      apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq g++ >/dev/null 2>&1
    } || echo "setup: could not install g++; DeepSpeed cannot start a process group on the CPU" >&2
  fi
  echo "setup: compiling DeepSpeed's CPU collectives once (about a minute)" >&2
  # Bounded: torch's extension builder waits forever on the lock file of a build that was killed half-way
  # (~/.cache/torch_extensions/*/deepspeed_shm_comm/lock); remove that file if this says it timed out.
  DS_ACCELERATOR=cpu timeout 900 "$VENV/bin/python" -c \
    "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)" \
    >/dev/null 2>&1 || echo "setup: DeepSpeed's CPU collectives did not compile (or waited 900 s on a stale lock" \
    "in ~/.cache/torch_extensions); tests/test_deepspeed.py will fail" >&2
  # DeepSpeedCPUAdam's op (ZeRO-Offload, the zoo's cpu_adam; tests/test_four_ranks.py), the same way: once, here,
  # so that no launch of 4 ranks compiles it. Measured clean, idle 2-core VM: 76 s (142 s CPU), 2.1 GB, 53 MB kept.
  echo "setup: compiling DeepSpeed's CPU Adam once (about 3 minutes of CPU)" >&2
  started=$SECONDS
  if DS_ACCELERATOR=cpu timeout 1800 "$VENV/bin/python" -c \
    "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" >/dev/null 2>&1; then
    echo "setup: DeepSpeed's CPU Adam compiled in $((SECONDS - started)) s" >&2
  else
    echo "setup: DeepSpeed's CPU Adam did not compile (no g++, or a stale lock in ~/.cache/torch_extensions);" \
      "the tests that need it skip without a compiler and fail with one" >&2
  fi
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
