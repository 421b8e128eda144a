#!/usr/bin/env bash
# On a GPU machine: the gpu-marked tiers tests, then benchmarks/bench_transfer.py.
# Logs go to $OUT (default ./out); the benchmark's table is printed last.
#   bash benchmarks/gpu_check_tiers.sh [bench_transfer.py options, e.g. --sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current,memory.used,memory.total --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
    grep -E 'MemTotal|MemAvailable' /proc/meminfo
} 2>&1 | tee "$OUT/machine.txt"

python3 -m pytest -m gpu tests/tiers -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE '^(PASSED|SKIPPED) '
tests_rc=${PIPESTATUS[0]}

python3 benchmarks/bench_transfer.py "$@" 2>&1 | tee "$OUT/bench_transfer.log" | grep -v '^{'
bench_rc=${PIPESTATUS[0]}
grep '^{' "$OUT/bench_transfer.log" >"$OUT/bench_transfer.jsonl" || true

echo "gpu tests exit $tests_rc, benchmark exit $bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
