# shellcheck shell=bash
# Sourced by .ci/run and scripts/*.sh: builds or reuses a cached Python 3.12 venv, keyed by a hash of the
# requirements, outside the clone (so repeated runs neither re-download nor fill the disk).
bfpp_find_python312() {
  if command -v python3.12 >/dev/null 2>&1 && PYENV_VERSION=3.12.1 python3.12 -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
    echo "env PYENV_VERSION=3.12.1 python3.12"; return
  fi
  for p in "$HOME/.pyenv/versions/"3.12.*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$p" ]; then echo "$p"; return; fi
  done
  echo "error: Python 3.12 not found (megatron-core>=0.17 needs it); install it, e.g. 'pyenv install 3.12.1'" >&2
  return 1
}

bfpp_venv() {
  local root key cache py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  key="$(sha256sum < "$root/requirements.txt" | cut -c1-16)"
  cache="${BFPP_VENV_CACHE:-$HOME/.cache/megatron_bfpp}"
  export BFPP_VENV="$cache/venv-$key"
  if [ ! -f "$BFPP_VENV/.complete" ]; then
    py="$(bfpp_find_python312)"
    mkdir -p "$cache"
    # Drop stale venvs of other requirement hashes: each is ~5.5 GB.
    find "$cache" -maxdepth 1 -name 'venv-*' ! -name "venv-$key" -exec rm -rf {} + 2>/dev/null || true
    rm -rf "$BFPP_VENV"
    $py -m venv "$BFPP_VENV"
    "$BFPP_VENV/bin/pip" install -q --upgrade pip
    "$BFPP_VENV/bin/pip" install -q -r "$root/requirements.txt"
    touch "$BFPP_VENV/.complete"
  fi
  # The package itself is installed editable each time (cheap), so the venv stays keyed by requirements only.
  "$BFPP_VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null 2>&1 || "$BFPP_VENV/bin/pip" install --no-deps --no-build-isolation -e "$root"
  export PATH="$BFPP_VENV/bin:$PATH"
}
