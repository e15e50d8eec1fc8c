# Sourced by the setup scripts: setup_env EXTRAS creates (or reuses) $VENV and installs
# torch==2.13.0 first (an unpinned torch would pull gigabytes of CUDA packages), then recserve.
VENV="${RECSERVE_VENV:-.venv}"
setup_env() {
  local extras="$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".${extras}"
  export PATH="$VENV/bin:$PATH"
}
