#!/usr/bin/env bash
# find_python.sh X.Y -> prints the path of a working Python X.Y interpreter that can make venvs, or fails saying so.
#
# `pythonX.Y` on PATH is not enough: pyenv's shim of that name exists for every installed version and fails when the
# global version is another one, so each candidate is run before it is believed.
set -u
want="${1:?usage: find_python.sh X.Y}"

candidates=("python$want")
if command -v pyenv >/dev/null 2>&1; then
  root="$(pyenv root 2>/dev/null)"
  candidates+=("$(PYENV_VERSION="$want" pyenv which "python$want" 2>/dev/null)")
  candidates+=("$root"/versions/"$want"*/bin/"python$want")
fi
candidates+=("$HOME"/.pyenv/versions/"$want"*/bin/"python$want" /usr/local/bin/"python$want" /usr/bin/"python$want")

for py in "${candidates[@]}"; do
  [ -n "$py" ] || continue
  if "$py" -c "import sys, venv, ensurepip; assert sys.version_info[:2] == tuple(map(int, '$want'.split('.')))" \
      >/dev/null 2>&1; then
    command -v "$py"
    exit 0
  fi
done
echo "find_python.sh: no working Python $want found (tried python$want on PATH, pyenv's versions/$want*," \
     "/usr/local/bin, /usr/bin); install it (e.g. 'pyenv install $want')" \
     "or name one with make PYTHON_TRAINER=/path/to/python$want" >&2
exit 1
