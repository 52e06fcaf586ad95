#!/usr/bin/env bash
# Everything the course checks on a CUDA GPU, in one go, with the machine's own Python (torch with CUDA, Triton):
#   bash benchmarks/gpu_session.sh OUT_DIR
# 1. the GPU and the versions; 2. the forward and forward + backward ladder against SDPA (bf16, batch 4, 16 heads,
# d 64 and 128, n 4,096 and 16,384, causal and not: the default kernel and the last rung), with the SM clock it ran
# at; 3. one decoding step against long caches, and the SM clock under a long matrix product; 4. the `gpu`-marked
# library tests beside every Colab edition run top to bottom. Each step
# has its own time limit, so one that hangs leaves the others their time; what each printed goes to OUT_DIR.
# Needs nbclient and ipykernel for step 4 (pip install nbclient ipykernel); without them that step says so.
set -u
out=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
py=${PYTHON:-python3}
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  $py -c 'import torch, triton, numpy, sys; p = torch.cuda.get_device_properties(0)
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, triton {triton.__version__}, numpy {numpy.__version__}")
print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
print("cudnn", torch.backends.cudnn.version())'
} 2>&1 | tee "$out/machine.txt"

# The ladder: SDPA, the default kernel (+atomic-dq) and the last rung (+tma, +lpt). SIGINT lets the CSV close.
# nvidia-smi samples the SM clock and the power meanwhile: the rates of every unit follow the clock.
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 \
  > "$out/ladder_clocks.csv" 2>&1 &
clocks=$!
timeout -s INT "${LADDER_SECONDS:-240}" $py benchmarks/bench_gpu.py --dtypes bfloat16 --d 64 128 \
  --sizes 4096 16384 --impls sdpa +atomic-dq +lpt --csv "$out/gpu_results.csv" 2>&1 | tee "$out/ladder.txt"
kill "$clocks" 2>/dev/null

timeout -s INT "${DECODE_SECONDS:-90}" $py benchmarks/bench_decode.py --csv "$out/decode_results.csv" 2>&1 |
  tee "$out/decode.txt"

# The SM clock under a long matrix product: chapter 8 prices every unit of the SM at one clock.
timeout "${CLOCK_SECONDS:-60}" $py benchmarks/clock_under_load.py 2>&1 | tee "$out/clock_under_load.txt"

# The tests and the chapters share the GPU: nothing is timed from here on.
timeout "${TEST_SECONDS:-200}" $py -m pytest -p no:cacheprovider -m gpu -n 4 -q -rfE tests/test_attention.py \
  tests/test_flash.py tests/test_flash_decode.py tests/test_flash_kernel.py tests/test_modules.py \
  > "$out/gpu_tests.txt" 2>&1 &
tests=$!
if $py -c 'import nbclient, ipykernel' 2>/dev/null; then
  timeout "${CHAPTER_SECONDS:-240}" $py tools/run_chapters.py --jobs 6 --timeout 300 colab/chapters/*.ipynb \
    > "$out/chapters.txt" 2>&1
else
  echo "nbclient and ipykernel are missing: the chapters were not run" > "$out/chapters.txt"
fi
wait $tests
tail -n 30 "$out/gpu_tests.txt"
cat "$out/chapters.txt"
