#!/usr/bin/env bash
# Device run for issue 16 (phase A): `unbroken bench gpu`, then the GPU tests.
# Usage (repository root on the GPU machine): OUT=dir bash bench/gpu_probe.sh [bench args]
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
if [ -n "${PROFILE:-}" ]; then python3 bench/gpu_step_profile.py --out $OUT $PROFILE 2>&1 | tee $OUT/step-profile.log; fi
python3 -m unbroken bench gpu --json "$@" 2> >(tee $OUT/bench-gpu.log >&2) | tee $OUT/bench-gpu.json
if [ -z "${NOTEST:-}" ]; then
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -p no:logging 2>&1 | tee $OUT/pytest-gpu.txt
fi
