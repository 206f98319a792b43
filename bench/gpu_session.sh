#!/usr/bin/env bash
# One device call (the lent GPU machine, its own python3 with torch + triton + transformers, this tree
# on PYTHONPATH, nothing installed): the GPU tests, then bench/gpu.py. Logs and gpu.json go to $OUT.
#   bash bench/gpu_session.sh                 # ~7 minutes on an H200
#   TESTS_ONLY=1 bash bench/gpu_session.sh    # the tests alone (~2 minutes)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" FERRYLM_DISABLE_CPU_KERNELS=1
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -n 4 -rs --durations=8 \
  tests/gpu/test_cuda.py tests/gpu/test_cuda_architectures.py tests/gpu/test_triton_compile.py \
  ${PYTEST_ARGS:-} >"$OUT/gpu_tests.log" 2>&1
echo "tests rc $?"
tail -c 6000 "$OUT/gpu_tests.log"
if [ -z "${TESTS_ONLY:-}" ]; then
  timeout "${BENCH_S:-320}" python3 bench/gpu.py --budget "${BUDGET:-270}" ${BENCH_ARGS:-} >"$OUT/gpu_bench.log" 2>&1
  echo "bench rc $?"
  tail -c 5000 "$OUT/gpu_bench.log"
fi
