#!/usr/bin/env bash
# On a GPU machine: the gpu-marked engine tests, then benchmarks/bench_engine.py.
# Logs go to $OUT (default ./out); the benchmark's table is printed last.
#   bash benchmarks/gpu_check_engine.sh [bench_engine.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.used,memory.total --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
    python3 -c "import sys, engine_integration.engine.embedded, storage_backends.file_store; print('lz4/redis imported:', [m for m in sys.modules if m.split('.')[0] in ('lz4', 'redis')])"
} 2>&1 | tee "$OUT/machine.txt"

python3 -m pytest -m gpu tests/engine_integration -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE '^(PASSED|SKIPPED) '
tests_rc=${PIPESTATUS[0]}

# hicache demo on the GPU (bf16, pinned L2): its totals only
XDG_CACHE_HOME="$OUT/xdg" python3 -m hicache.cli demo --device cuda --fresh >"$OUT/demo_cuda.log" 2>&1
echo "demo on cuda exit $?"; grep -A4 '^totals' "$OUT/demo_cuda.log"
rm -rf "$OUT/xdg"

python3 benchmarks/bench_engine.py "$@" 2>&1 | tee "$OUT/bench_engine.log" | grep -v '^{'
bench_rc=${PIPESTATUS[0]}
grep '^{' "$OUT/bench_engine.log" >"$OUT/bench_engine.jsonl" || true

echo "gpu tests exit $tests_rc, benchmark exit $bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
