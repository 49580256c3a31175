#!/usr/bin/env bash
# Set up and run xinsitu on a fresh machine (only Python >= 3.11 and pip needed).
#   bash dev.sh demo [ARCHIVE]   set up, then train a tiny model from ARCHIVE (a synthetic one if none)
#   bash dev.sh test [ARGS...]   set up, then run the whole test suite (pytest ARGS)
#   bash dev.sh bench [ARGS...]  set up (with benchmark extras), then run bench/run.py
set -euo pipefail
cd "$(dirname "$0")"
VENV="${XINSITU_VENV:-.venv}"
PY="${PYTHON:-python3}"

setup() {
  local extras="$1"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  local stamp="$VENV/.xinsitu-$extras"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ dev.sh -nt "$stamp" ]; then
    python -m pip install -q --disable-pip-version-check --upgrade pip
    # Without CUDA, the pinned CPU build of torch (a bare `torch` would pull GBs of CUDA wheels).
    if ! command -v nvidia-smi >/dev/null 2>&1; then
      python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    fi
    python -m pip install -q --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
  fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup "torch"
    exec python examples/train_demo.py "$@"
    ;;
  test)
    setup "torch,dev,bench"
    set +e
    python -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc"
    ;;
  bench)
    setup "torch,dev,bench"
    exec python bench/run.py "$@"
    ;;
  *)
    sed -n '2,5p' "$0" >&2
    exit 2
    ;;
esac
