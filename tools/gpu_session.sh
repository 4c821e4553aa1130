#!/usr/bin/env bash
# The GPU measurements still owed, in phases that each fit one 10-minute device call.
#
#   ../shared/device/wheels.sh orjson ijson filelock platformdirs gguf      # here, once
#   bash tools/device_setup.sh bash tools/gpu_session.sh verify             # on the device (carry .whl)
#
# Phases (outputs under $OUT/<phase>/, progress on stdout so a cut-off run still says where
# it got):
#   verify   GPU-only tests and the demo: the read-only job file system's first GPU run
#   power    bench_judge's power test, 10 tries (run it twice for the 20)
#   judge    turnaround and fidelity
#   kernels  tilings sweep, then the roofline table
#   loop     every kernel task through submit_candidate over MCP (evidence ids)
#   model    the Llama-3-8B-shaped model program: decode, prefill, logits check
set -uo pipefail
phase=${1:?phase: verify|power|judge|kernels|loop|model}
out=${OUT:-.}/$phase
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
case "$phase" in
  verify)
    timeout 200 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -15 | tee "$out/pytest_gpu.txt"
    (time timeout 300 loom-mcp demo) > "$out/demo.txt" 2>&1; tail -12 "$out/demo.txt" ;;
  power)
    timeout 560 python3 tools/bench_judge.py --only power --tries 10 --max-time-s 3 --out "$out" \
      | grep -v "^{" | tail -14 ;;
  judge)
    timeout 560 python3 tools/bench_judge.py --only turnaround,fidelity --out "$out" | tail -20 ;;
  kernels)
    timeout 300 python3 tools/sweep_q4k.py --out "$out" | grep -v Warn | tail -30
    timeout 260 python3 tools/bench_kernels.py --out "$out" > "$out/bench_kernels.log" 2>&1
    tail -40 "$out/bench_kernels.log" ;;
  loop)
    timeout 570 python3 tools/kernels_campaign.py --out "$out" --home /tmp/loom-kc 2>&1 \
      | grep -v "pairs,\|running [0-9]" | tail -60 ;;
  model)
    timeout 560 python3 -m kernels.llama_q4k.bench --random-config llama3-8b --gen 64 --runs 2 \
      > "$out/llama3-8b.json" 2> "$out/llama3-8b.err"; tail -c 3000 "$out/llama3-8b.json"; tail -5 "$out/llama3-8b.err" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
