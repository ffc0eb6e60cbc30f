# Sourced by the A/B scripts: `old_tree REV` checks REV out into a throwaway worktree with its
# own editable install in a virtual environment that borrows this one's dependencies (run
# from this project's activated environment). Sets $work (a temporary folder, removed on exit;
# run the old tree's commands from there so python does not find this tree's quantkit/ first)
# and $old_python.
old_tree() {
  local rev=$1 repo site
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  work=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "git -C '$repo' worktree remove --force '$work/tree' >/dev/null 2>&1 || true; rm -rf '$work'" EXIT
  site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  git -C "$repo" worktree add --detach "$work/tree" "$rev" >/dev/null
  python -m venv "$work/venv"
  # this environment's packages, after the old tree's own (a .pth line, not PYTHONPATH, so the
  # old tree's editable finder is found first)
  echo "$site" > "$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deps.pth"
  "$work/venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$work/tree" 2>/dev/null \
    || "$work/venv/bin/python" -m pip install --quiet --no-deps -e "$work/tree"
  old_python=$work/venv/bin/python
}
