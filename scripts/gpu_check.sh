#!/usr/bin/env bash
# The GPU path in one run, at most 8 minutes, on a CUDA machine (run it first when one is at hand):
#   1. the bf16 kernel tests (tests marked `gpu`: Triton kernels against the torch reference);
#   2. scripts/bench_kernels.py: decode attention bandwidth as a fraction of the device's peak,
#      against torch's own SDPA on the same shapes, and prefill tokens/s (its tables);
#   3. scripts/check_host_copy.py: the host tier's side-stream copies, checked exactly, then timed;
#   4. scripts/bench_worker.py: a worker end to end on a preset, tokens/s, paged against static.
# Prints one summary (each step: ok / FAIL / TIMEOUT, its seconds and its headline lines); exits 1
# when a step failed, 2 without CUDA. Usage: bash scripts/install.sh test && bash scripts/gpu_check.sh
#   KVPOOL_PYTHON       the interpreter (default .venv/bin/python)
#   KVPOOL_GPU_PRESET   bench_worker's preset (default llama-3.2-1b)
#   KVPOOL_GPU_OUT      where the full logs go (default a temp dir, named in the summary)
set -uo pipefail
cd "$(dirname "$0")/.."
py="${KVPOOL_PYTHON:-.venv/bin/python}"
preset="${KVPOOL_GPU_PRESET:-llama-3.2-1b}"
out="${KVPOOL_GPU_OUT:-$(mktemp -d -t kvpool-gpu-check-XXXX)}"
mkdir -p "$out"

if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $py (torch.cuda.is_available() is False, or torch is" >&2
    echo "missing): this script checks the GPU path and needs one. Nothing was run." >&2
    exit 2
fi
device="$("$py" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")')"

names=() states=() secs=() heads=()
failed=0
# step NAME SECONDS HEADLINE_REGEX CMD...: runs CMD under a time limit into $out/NAME.log
step() {
    local name="$1" limit="$2" pattern="$3"
    shift 3
    local t0=$SECONDS rc
    echo "gpu_check: $name (limit ${limit}s) ..." >&2
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local state=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then state=TIMEOUT; elif [ "$rc" -ne 0 ]; then state="FAIL (exit $rc)"; fi
    [ "$state" = ok ] || failed=1
    names+=("$name") states+=("$state") secs+=($((SECONDS - t0)))
    heads+=("$(grep -E "$pattern" "$out/$name.log" | tail -n 12)")
}

# 150 + 120 + 90 + 120 = 480 s at most
step kernel-tests 150 'passed|failed|error' \
    "$py" -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/worker
step bench-kernels 120 'peak|GB/s|speedup|batch|^ +[0-9]' \
    "$py" scripts/bench_kernels.py --repeats 20
step host-copy 90 'ok|FAIL|ms|x ' \
    "$py" scripts/check_host_copy.py
step worker-e2e 120 'tokens/s|ratio|note' \
    "$py" scripts/bench_worker.py --device cuda --model "$preset" --modes static,paged --requests 64 \
    --min-prompt 64 --max-prompt 512 --min-output 32 --max-output 256 --max-model-len 1024 --kv-blocks 1025

echo
echo "== gpu_check summary: $device =="
for i in "${!names[@]}"; do
    printf '%-14s %-16s %4ss\n' "${names[$i]}" "${states[$i]}" "${secs[$i]}"
    [ -n "${heads[$i]}" ] && printf '%s\n' "${heads[$i]}" | sed 's/^/    /'
done
echo "full logs: $out"
exit "$failed"
