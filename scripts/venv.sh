# shellcheck shell=bash
# Sourced by .ci/run and scripts/*.sh: builds or reuses a cached Python 3.12 venv, keyed by a hash of its
# requirements file, outside the clone (so repeated runs neither re-download nor fill the disk). Two kinds share
# the cache folder, each dropping only its own stale copies: `venv-<hash>` (requirements.txt, bfpp_venv) and
# `floorvenv-<hash>` (requirements-floor.txt, torch at pyproject's floor, bfpp_floor_venv).
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

# _bfpp_cached_venv REQUIREMENTS PREFIX: prints the venv's path, building it first if needed. A torch pin in the
# file is installed first, alone, so that the rest resolves against it and keeps it.
_bfpp_cached_venv() {
  local reqs="$1" prefix="$2" key cache venv py torch_pin
  key="$(sha256sum < "$reqs" | cut -c1-16)"
  cache="${BFPP_VENV_CACHE:-$HOME/.cache/megatron_bfpp}"
  venv="$cache/$prefix-$key"
  if [ ! -f "$venv/.complete" ]; then
    py="$(bfpp_find_python312)" || return 1
    mkdir -p "$cache"
    # Drop stale venvs of this kind (other hashes of the same file): each is ~5.5 GB. The names of the kinds
    # differ before the dash ("venv-", "floorvenv-"), so neither pattern matches the other kind.
    find "$cache" -maxdepth 1 -name "$prefix-*" ! -name "$prefix-$key" -exec rm -rf {} + 2>/dev/null || true
    rm -rf "$venv"
    $py -m venv "$venv" >&2 || return 1
    "$venv/bin/pip" install -q --upgrade pip >&2 || return 1
    torch_pin="$(sed -n 's/^\(torch==[^[:space:]#]*\).*/\1/p' "$reqs" | head -n 1)"
    if [ -n "$torch_pin" ]; then "$venv/bin/pip" install -q "$torch_pin" >&2 || return 1; fi
    "$venv/bin/pip" install -q -r "$reqs" >&2 || return 1
    touch "$venv/.complete"
  fi
  echo "$venv"
}

# _bfpp_install_editable VENV: the package itself, installed editable each time (cheap), so the venv stays keyed
# by its requirements only.
_bfpp_install_editable() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  "$1/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null 2>&1 || "$1/bin/pip" install --no-deps --no-build-isolation -e "$root"
}

# The main venv (requirements.txt): exports BFPP_VENV and puts it first on PATH.
bfpp_venv() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  BFPP_VENV="$(_bfpp_cached_venv "$root/requirements.txt" venv)" || return 1
  export BFPP_VENV
  _bfpp_install_editable "$BFPP_VENV"
  export PATH="$BFPP_VENV/bin:$PATH"
}

# The floor venv (requirements-floor.txt: torch at pyproject's floor): exports BFPP_FLOOR_VENV; PATH and the
# package's install are left to the caller (.ci/run installs it as README says and checks torch is kept).
bfpp_floor_venv() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  BFPP_FLOOR_VENV="$(_bfpp_cached_venv "$root/requirements-floor.txt" floorvenv)" || return 1
  export BFPP_FLOOR_VENV
}
