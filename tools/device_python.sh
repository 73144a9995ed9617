#!/usr/bin/env bash
# Python as the GPU machine sees this repository: the device's triton (3.6.0, from
# .venv-device) ahead of .venv's packages (its CPU torch stands in for the device's
# 2.11: no CPU build of 2.11 exists), and -S, so no site-packages .pth runs and the
# editable cp-compile install is invisible: `cp_compile.ops` resolves through
# tools/devcheck/repo_imports.py exactly as on the bare machine. Made by tools/bootstrap.sh.
#   tools/device_python.sh tools/device_check.py --rehearse --out /tmp/dc
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -d "$root/.venv-device/triton" ]; then
  echo "no $root/.venv-device (triton 3.6.0): run tools/bootstrap.sh" >&2
  exit 2
fi
site="$("$root/.venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
PYTHONPATH="$root/.venv-device:$site${PYTHONPATH:+:$PYTHONPATH}" exec "$root/.venv/bin/python" -S "$@"
