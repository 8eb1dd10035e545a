#!/usr/bin/env bash
# The GPU path, proven on one GPU in under 8 minutes, in one prepared run:
#   1. the CUDA tests (tests/test_cuda.py): bf16 base + fp32 LoRA, isolation joint vs solo,
#      gradients vs PEFT on the device, greedy sampling = argmax, checkpoint round trips;
#   2. benchmarks/vs_peft.py on CUDA: the built-in model and a random-init ~0.5B-shaped Llama
#      (24 layers, d=896, vocab 151936), tokens/s and peak memory for ours and PEFT's.
#      Targets: >= 1.0x PEFT's tokens/s for one tenant that saturates the device (16x512
#      tokens), >= 4x for 8 tenants of 2x128 tokens packed vs one after another;
#   3. benchmarks/sampling.py on CUDA: 8 tenants x 4 samples, the pool's tokens/s against PEFT
#      generate (one adapter after another, and one fused batch) and the device's matmul limit,
#      on the built-in model and the Llama shape (8 layers, d=512, vocab 32000; bf16 base).
#
# Usage: benchmarks/gpu_check.sh [--dry-run]
#   --dry-run  the same steps on CPU with tiny shapes and one repetition: proves the plumbing
#              where there is no GPU (tests/test_gpu_check.py runs it).
# $PYTHON picks the interpreter (default: .venv/bin/python, else python3). Exit status: 0 when
# every step ran and passed; the figures are for reading, not asserted.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, even beside an installed copy
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # nothing here needs the network

started=$SECONDS
failed=()
step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, record a failure, go on
  local name=$1 limit=$2; shift 2
  echo "== $name =="
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "!! $name: stopped after its ${limit} s limit"; failed+=("$name (timed out)")
  elif [[ $rc -ne 0 ]]; then
    echo "!! $name: exit status $rc"; failed+=("$name (exit $rc)")
  fi
  echo "-- $name: $((SECONDS - t0)) s"
}

echo "== environment =="
"$PYTHON" - <<'EOF'
import platform, torch, transformers, peft
cuda = torch.cuda.is_available()
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"device: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.0f} GiB, "
          f"compute capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")
else:
    print("device: no CUDA")
EOF
if [[ $DRY_RUN -eq 0 ]] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device here: run '$0 --dry-run' to test the plumbing on CPU" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null && [[ $DRY_RUN -eq 0 ]] && \
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu --format=csv

echo "== packed attention kernel =="
"$PYTHON" - <<'EOF'
import torch
from trio_widgets.engine.packing import _varlen_works
for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
    for dtype in (torch.bfloat16, torch.float32):
        used = device == "cuda" and _varlen_works(torch.device(device), dtype)
        print(f"{device} {str(dtype).removeprefix('torch.')}: "
              f"{'varlen FlashAttention (self-check passed)' if used else 'grouped SDPA'}")
EOF

if [[ $DRY_RUN -eq 1 ]]; then
  echo "(dry run: CPU, tiny shapes, one repetition; the figures mean nothing)"
  TRIO_CUDA_TESTS_ON_CPU=1 TRIO_TORCH_THREADS=1 \
    step "CUDA tests (on CPU: dry run)" 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider -W ignore::FutureWarning tests/test_cuda.py
  step "vs_peft.py (on CPU: dry run)" 240 "$PYTHON" benchmarks/vs_peft.py --device cpu --threads auto \
    --shape tiny --reps 1 --tenants 3 --batch 2x16 --single-batch 4x16
  step "sampling.py (on CPU: dry run)" 120 "$PYTHON" benchmarks/sampling.py --device cpu --shapes builtin \
    --reps 1 --new 4
else
  step "CUDA tests" 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider -W ignore::FutureWarning tests/test_cuda.py
  step "vs_peft.py on CUDA" 300 "$PYTHON" benchmarks/vs_peft.py --device cuda --shape 0.5b --reps 7 \
    --batch 2x128 --single-batch 16x512
  step "sampling.py on CUDA" 240 "$PYTHON" benchmarks/sampling.py --device cuda --shapes builtin,llama --reps 3
fi

echo "== gpu_check done in $((SECONDS - started)) s: ${#failed[@]} step(s) failed =="
for f in "${failed[@]}"; do echo "   failed: $f"; done
[[ ${#failed[@]} -eq 0 ]]
