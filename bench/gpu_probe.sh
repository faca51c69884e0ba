#!/usr/bin/env bash
# Device run for issue 16 (phase A): GPU tests of the new kernels, then `unbroken bench gpu`.
# Usage (repository root on the GPU machine): OUT=dir bash bench/gpu_probe.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
python3 -c "import inspect; from torch.nn.attention.varlen import varlen_attn; print(inspect.signature(varlen_attn))" | tee -a $OUT/env.txt
df -h /tmp | tee -a $OUT/env.txt
python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee $OUT/pytest-gpu.txt
python3 -m unbroken bench gpu --compile --json "$@" 2> >(tee $OUT/bench-gpu.log >&2) | tee $OUT/bench-gpu.json
