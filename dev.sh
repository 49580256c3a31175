#!/usr/bin/env bash
# Set up and run xinsitu on a fresh machine (only Python >= 3.11 and pip needed).
#   bash dev.sh demo [ARCHIVE]   set up, then train a tiny model from ARCHIVE (a synthetic one if none)
#   bash dev.sh test [ARGS...]   set up, then run everything twice (pytest ARGS): Python 3.11 with torch, and
#                                Python 3.12 with the newest zarr/numpy/xarray, without torch; both must pass. Each
#                                leg: the library's tests, then ruff (3.11), then the tools step (mypy, the docs
#                                build, the notebook, the benchmarks' smoke: tests marked `tools`), each step in
#                                3 pytest-xdist workers (XINSITU_TEST_WORKERS=N sets how many; 0: one process)
#   bash dev.sh test --fast [ARGS...]  the library's tests on 3.11 only, without `slow` and `tools` (minutes)
#   bash dev.sh bench [ARGS...]  set up (with benchmark extras), then run bench/run.py
# PYTHON (python3) makes .venv; PYTHON312 (python3.12, else pyenv's 3.12.1) makes .venv-py312 for the second leg.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${XINSITU_VENV:-.venv}"
PY="${PYTHON:-python3}"
VENV312="${XINSITU_VENV312:-.venv-py312}"

# setup VENV PYTHON EXTRAS [eager]: make VENV with PYTHON, install the project with EXTRAS when pyproject.toml or
# dev.sh changed since; "eager" upgrades every dependency to the newest the registry serves.
setup() {
  local venv="$1" py="$2" extras="$3" eager="${4:-}"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  local stamp="$venv/.xinsitu-$extras"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ dev.sh -nt "$stamp" ]; then
    python -m pip install -q --disable-pip-version-check --upgrade pip
    if [ -n "$eager" ]; then
      python -m pip install -q --disable-pip-version-check --upgrade --upgrade-strategy eager -e ".[$extras]"
    else
      # Without CUDA, the pinned CPU build of torch (a bare `torch` would pull GBs of CUDA wheels).
      if ! command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install -q --disable-pip-version-check "torch==2.13.0"
      fi
      # this leg keeps Icechunk 1.x, the eager one gets the newest (2.x): both majors are tested
      python -m pip install -q --disable-pip-version-check -e ".[$extras]" "icechunk<2"
    fi
    touch "$stamp"
  fi
}

python312() {
  # the first that runs and is 3.12 (pyenv's shim of python3.12 exists but may refuse to run)
  local c
  for c in "${PYTHON312:-}" python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python"; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      command -v "$c"
      return
    fi
  done
}

# leg NAME ARGS...: run pytest in the active venv under a header; prints and returns its status (5: no test ran).
leg() {
  local name="$1"
  shift
  echo "==== xinsitu test leg: $name ($(python -c 'import platform; print(platform.python_version())'))"
  python -m xinsitu doctor || true
  local t0=$SECONDS rc=0 n="${XINSITU_TEST_WORKERS:-3}"
  # XINSITU_TEST_WORKERS: pytest-xdist worker processes (default 3; 0: one process). The suite waits on
  # servers, child processes and timeouts a good part of its time (one process keeps about 1.3 of 2 cores
  # busy): on 2 cores 3 workers take less than half the time of one process (README).
  if [ "$n" -gt 0 ]; then set -- -n "$n" "$@"; fi
  python -m pytest "$@" || rc=$?
  echo "==== leg $name: pytest exit $rc in $((SECONDS - t0)) s"
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; rc=1; fi
  return "$rc"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup "$VENV" "$PY" "torch"
    exec python examples/train_demo.py "$@"
    ;;
  test)
    setup "$VENV" "$PY" "torch,dev,bench"
    if [ "${1:-}" = "--fast" ]; then
      shift
      leg "fast: python3.11 + torch, without slow and tools tests" -m "not slow and not tools" "$@"
      exit
    fi
    rc1=0
    leg "python3.11 + torch" -m "not tools" "$@" || rc1=$?
    echo "==== ruff"
    python -m ruff check xinsitu tests bench examples || rc1=$?
    leg "python3.11: tools (mypy, docs build, notebook, bench smoke)" -m tools "$@" || rc1=$?
    deactivate
    rc2=0
    py312="$(python312)"
    if [ -n "$py312" ]; then
      setup "$VENV312" "$py312" "dev,bench" eager
      leg "python3.12, newest deps, no torch" -m "not tools" "$@" || rc2=$?
      leg "python3.12: tools" -m tools "$@" || rc2=$?
    else
      echo "no Python 3.12 found (set PYTHON312): the second leg cannot run: failing" >&2
      rc2=1
    fi
    echo "==== legs: python3.11 exit $rc1, python3.12 exit $rc2"
    [ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
    ;;
  bench)
    setup "$VENV" "$PY" "torch,dev,bench"
    exec python bench/run.py "$@"
    ;;
  *)
    sed -n '2,10p' "$0" >&2
    exit 2
    ;;
esac
