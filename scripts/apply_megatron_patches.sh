#!/usr/bin/env bash
# Apply megatron_bfpp's patch series to a Megatron-LM checkout: pretrain_gpt.py gains the plugin's flags
# (--pipeline-schedule, --zero-stage, ...) and installs the plugin after argument validation.
# The series is chosen by the checkout's git tag, else by its megatron/core/package_info.py version.
#
# usage: scripts/apply_megatron_patches.sh [--dry-run] [--no-commit] [--tag TAG] MEGATRON_LM_DIR
#   --dry-run    print the detected tag and the commands, check that the series applies, change nothing
#   --no-commit  apply with `git apply` (working-tree changes only) instead of `git am` (one commit per patch)
#   --tag TAG    use patches/megatron-lm/TAG instead of detecting it
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERIES_ROOT="$ROOT/patches/megatron-lm"
DRY_RUN=0
NO_COMMIT=0
TAG=""
DIR=""

die() { echo "apply_megatron_patches: error: $*" >&2; exit 1; }
usage() { sed -n '5,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
available() {
  local d
  for d in "$SERIES_ROOT"/*/; do [ -d "$d" ] && printf '%s ' "$(basename "$d")"; done
}

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --no-commit) NO_COMMIT=1 ;;
    --tag) [ $# -ge 2 ] || die "--tag needs a value (one of: $(available))"; TAG="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$DIR" ] || die "give one MEGATRON_LM_DIR (got '$DIR' and '$1')"; DIR="$1" ;;
  esac
  shift
done
[ -n "$DIR" ] || { usage >&2; die "missing MEGATRON_LM_DIR"; }
[ -d "$DIR" ] || die "$DIR is not a directory"
[ -f "$DIR/pretrain_gpt.py" ] || die "$DIR has no pretrain_gpt.py: point MEGATRON_LM_DIR at a Megatron-LM checkout"

is_git=0
if git -C "$DIR" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
  && [ "$(git -C "$DIR" rev-parse --show-toplevel)" = "$(cd "$DIR" && pwd -P)" ]; then
  is_git=1
fi

detect_tag() {
  local t major minor info
  if [ "$is_git" = 1 ]; then
    # Exact tag first, then the nearest one (a checkout a few commits past a release).
    for t in $(git -C "$DIR" tag --points-at HEAD 2>/dev/null) $(git -C "$DIR" describe --tags --abbrev=0 2>/dev/null); do
      if [ -d "$SERIES_ROOT/$t" ]; then echo "$t"; return 0; fi
    done
  fi
  info="$DIR/megatron/core/package_info.py"
  if [ -f "$info" ]; then
    major="$(sed -n 's/^MAJOR *= *\([0-9][0-9]*\).*/\1/p' "$info")"
    minor="$(sed -n 's/^MINOR *= *\([0-9][0-9]*\).*/\1/p' "$info")"
    if [ -n "$major" ] && [ -n "$minor" ]; then
      for t in "$SERIES_ROOT"/core_v"$major"."$minor".*; do
        if [ -d "$t" ]; then basename "$t"; return 0; fi
      done
      echo "version $major.$minor"
      return 1
    fi
  fi
  echo "no tag or version file"
  return 1
}

if [ -z "$TAG" ]; then
  if ! TAG="$(detect_tag)"; then
    die "$DIR: $TAG has no patch series; supported: $(available)(or pass --tag, or use the no-patch script runner: python -m megatron_bfpp.run_megatron_script $DIR/pretrain_gpt.py ...)"
  fi
fi
SERIES="$SERIES_ROOT/$TAG"
[ -d "$SERIES" ] || die "no patch series $TAG; supported: $(available)"
PATCHES=()
for p in "$SERIES"/*.patch; do PATCHES+=("$p"); done
[ -e "${PATCHES[0]}" ] || die "$SERIES holds no .patch files"
REVERSED=()
for ((i = ${#PATCHES[@]} - 1; i >= 0; i--)); do REVERSED+=("${PATCHES[$i]}"); done

echo "Megatron-LM checkout: $DIR (series $TAG, ${#PATCHES[@]} patch(es))"
if git -C "$DIR" apply --check "${PATCHES[@]}" 2>/dev/null; then
  :
elif git -C "$DIR" apply -R --check "${REVERSED[@]}" 2>/dev/null; then
  echo "already applied: nothing to do"
  exit 0
else
  git -C "$DIR" apply --check "${PATCHES[@]}" || true
  die "the $TAG series does not apply to $DIR (local changes to pretrain_gpt.py, or another version: pass --tag)"
fi

if [ "$is_git" = 1 ] && [ "$NO_COMMIT" = 0 ]; then
  CMD=(git -C "$DIR")
  # git am records a commit: give it an identity when the checkout has none.
  if ! git -C "$DIR" config user.email >/dev/null 2>&1; then
    CMD+=(-c user.name=megatron_bfpp -c user.email=megatron_bfpp@localhost)
  fi
  CMD+=(am --3way "${PATCHES[@]}")
else
  CMD=(git -C "$DIR" apply "${PATCHES[@]}")
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: the series applies cleanly; would run:"
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
"${CMD[@]}"
echo "applied: $DIR/pretrain_gpt.py accepts --pipeline-schedule breadth-first (see docs/megatron.md)"
