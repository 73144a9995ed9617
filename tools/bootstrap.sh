#!/usr/bin/env bash
# Make the project's virtual environments; the README's two commands and .ci/run call it.
#   .venv          the CPU torch 2.13.0, cp-compile (editable) with the test extra (upstream triton),
#                  and nixl-cu12 (the KV-transfer transport, cp_compile.serving.kv_transfer): --no-deps, since
#                  its requirements are torch and numpy, both already here; unpinned deps would pull
#                  a CUDA torch (the `nixl` meta-package pulls CUDA torch and both cu12 / cu13 builds)
#   .venv-device   not a venv: triton 3.6.0 (the GPU machine's version) and numpy 2.3.5, `pip install --target`;
#                  tools/device_python.sh runs .venv's python with -S (no site, so no editable
#                  cp-compile: the repository imports as laid out, as on the bare GPU machine) and
#                  this triton ahead of .venv's packages, for the device check's rehearsal
#                  (tests/ops/test_device_check.py; docs/decisions.md 59). ~10 s with a warm pip cache.
#   .venv-ascend   with --with-ascend: the CPU torch, triton-ascend 3.2.0 + pybind11 and
#                  cp-compile (editable), for the Triton-Ascend lowering check
#                  (python -m tools.ascend_check). triton-ascend owns the
#                  `triton` module name, so it cannot share .venv with upstream triton.
#   .venv-torchair with --with-ascend: the CPU torch, torch-npu 2.13.0 (for the torchair inside
#                  it; torch_npu itself is never imported), protobuf, packaging and cp-compile
#                  (editable), for the torchair GE-graph check (python -m tools.ge_check),
#                  which stands in torchair's one C++ extension (needs CANN). With torch-npu
#                  installed, `import torch` needs TORCH_DEVICE_BACKEND_AUTOLOAD=0 (the check's
#                  test sets it), so it gets its own environment.
# torch goes first in each, pinned, so pip takes the CPU build on this machine's disk
# (an unpinned torch would pull a multi-GB CUDA build). Versions: .ci/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

with_ascend=0
for arg in "$@"; do
  case "$arg" in
    --with-ascend) with_ascend=1 ;;
    *) echo "usage: $0 [--with-ascend]" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
pins=.ci/constraints.txt

echo "[bootstrap] .venv: torch (CPU), cp-compile[test]" >&2
"$python" -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c "$pins" -e '.[test]'
.venv/bin/pip install -q -c "$pins" --no-deps nixl-cu12

echo "[bootstrap] .venv-device: triton 3.6.0 (the GPU machine's) for the device check's rehearsal" >&2
rm -rf .venv-device
# numpy 2.3: triton 3.6's interpreter calls int() on 1-element arrays, an error from numpy 2.4 on
# (the GPU machine compiles, so its numpy 2.5 never meets the interpreter; decisions.md 59)
.venv/bin/pip install -q --no-deps --target .venv-device triton==3.6.0 numpy==2.3.5

if [ "$with_ascend" = 1 ]; then
  echo "[bootstrap] .venv-ascend: torch (CPU), triton-ascend, cp-compile" >&2
  "$python" -m venv .venv-ascend
  .venv-ascend/bin/pip install -q torch==2.13.0
  .venv-ascend/bin/pip install -q -c "$pins" -e . triton-ascend pybind11
  echo "[bootstrap] .venv-torchair: torch (CPU), torch-npu (torchair), protobuf, packaging, cp-compile" >&2
  "$python" -m venv .venv-torchair
  .venv-torchair/bin/pip install -q torch==2.13.0
  .venv-torchair/bin/pip install -q -c "$pins" -e . torch-npu protobuf packaging
fi
