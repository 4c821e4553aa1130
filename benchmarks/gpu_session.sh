#!/usr/bin/env bash
# The GPU measurements still owed, in phases that each fit one 10-minute device call.
#
#   ../shared/device/wheels.sh orjson ijson filelock platformdirs gguf ninja tomlkit     # here, once
#   bash benchmarks/device_setup.sh bash benchmarks/gpu_session.sh verify  # on the device (carry .whl)
#
# Phases (outputs under $OUT/<phase>/, progress on stdout so a cut-off run still says where
# it got):
#   verify      GPU-only tests and the demo: the read-only job file system's first GPU run
#   power       bench_judge's power test, $TRIES tries (default 10)
#   startup     where a worker process's start-up goes (bare, import torch, device init, sandbox)
#   turnaround  compile + validate + benchmark of a Triton candidate over 6 shapes, cold and warm
#   fidelity    our medians against ncu's
#   repeat      CV of the median over 5 benchmark calls, a >= 20 us and a <= 5 us kernel
#   sweep       Q4_K GEMV tilings (CUDA-core and tensor-core kernels) and rmsnorm rows per program
#   floor       the Q4_K GEMV against kernels that only read its weight (tiled as it is, and flat)
#   cuda        the candidate's CUDA batch-1 Q4_K GEMV: checks, then timed against its Triton kernel
#               (CUDA_AGAINST=path/to/other/q4k_gemv.py: and against that file's CUDA kernels;
#               CUDA_CANDIDATE=path: another q4k_gemv.py in its place; CUDA_BATCH=N: batch N,
#               Triton against one CUDA launch per row; CUDA_K_PARTS=1,2,7: the batched kernel
#               also with K cut into those numbers of parts; CUDA_VARIANTS,
#               CUDA_ROUNDS, CUDA_TIMEOUT: see kernels/tools/probe_q4k_cuda.py --help)
#   ncu         Nsight Compute on that kernel ($NCU_SHAPE, default 14336x4096): where warps stall
#   timeline    that kernel CTA by CTA from the global timer, with and without its arithmetic
#               ($TIMELINE_SHAPES, default 14336x4096,4096x14336,4096x4096)
#   stream      the streaming floors of that kernel's producer/consumer structure (no arithmetic)
#   attention   the model's decode attention, variants against RoPE + SDPA
#   loop        every kernel task (or $LOOP_TASKS, comma-separated) through submit_candidate over MCP
#   model       the Llama-3-8B-shaped model program: decode, prefill, logits check
#   vision      the layernorm and gelu kernels' self-checks, the image tests on the GPU, and
#               the LLaVA-1.5-shaped vision tower: encode time, kernels against plain ops
#               (needs pillow and transformers among the carried wheels for the tests)
#   pack        (also done after the last phase) the device returns at most 8 files from $OUT:
#               more are packed into $OUT/session.tgz (tar xzf it where they land)
# Several phases in one call: bash benchmarks/gpu_session.sh verify turnaround loop
set -uo pipefail

pack() {
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  local files
  files=$(find "$OUT" -type f ! -name session.tgz | wc -l)
  [ "$files" -gt 8 ] || return 0
  (cd "$OUT" && tar czf session.tgz --exclude=./session.tgz . \
    && find . -mindepth 1 -maxdepth 1 ! -name session.tgz -exec rm -rf {} +) \
    && echo "== packed $files files into $OUT/session.tgz"
}

for phase in "$@"; do
if [ "$phase" = pack ]; then pack; continue; fi
out=${OUT:-.}/$phase
mkdir -p "$out"
echo "== $phase $(date -u +%T)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
case "$phase" in
  verify)
    timeout 200 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -15 | tee "$out/pytest_gpu.txt"
    (time timeout 300 loom-mcp demo) > "$out/demo.txt" 2>&1; tail -12 "$out/demo.txt" ;;
  power)
    timeout "${POWER_S:-560}" python3 benchmarks/bench_judge.py --only power --tries "${TRIES:-10}" \
      --out "$out" 2> "$out/log.txt" | grep -v "^{" | tail -24 ;;
  startup)
    timeout 200 python3 benchmarks/probe_startup.py --reps 3 2>&1 | grep -v Warn | tee "$out/startup.txt" ;;
  turnaround|fidelity|repeat)
    timeout 400 python3 benchmarks/bench_judge.py --only "$phase" --out "$out" 2> "$out/log.txt" | grep -v "^ \|^{\|^}" | tail -20
    grep -v Warn "$out/log.txt" | tail -40 ;;
  sweep)
    timeout 300 python3 kernels/tools/sweep_q4k.py --only gemv,rmsnorm --out "$out" | grep -v Warn | tail -30 ;;
  floor)
    timeout 200 python3 kernels/tools/sweep_q4k.py --only floor --out "$out" | grep -v Warn | tail -10 ;;
  cuda)
    timeout "${CUDA_TIMEOUT:-400}" python3 kernels/tools/probe_q4k_cuda.py --out "$out" --rounds "${CUDA_ROUNDS:-1}" ${CUDA_VARIANTS:+--variants $CUDA_VARIANTS} \
      ${CUDA_AGAINST:+--against $CUDA_AGAINST} ${CUDA_CANDIDATE:+--candidate $CUDA_CANDIDATE} ${CUDA_BATCH:+--batch $CUDA_BATCH} ${CUDA_K_PARTS:+--k-parts $CUDA_K_PARTS} 2>&1 | grep -v Warn | tail -24 ;;
  ncu)
    timeout 400 python3 kernels/tools/ncu_q4k_gemv.py --out "$out" --shape "${NCU_SHAPE:-14336x4096}" 2>&1 | grep -v Warn | tail -45 ;;
  timeline)
    timeout 400 python3 kernels/tools/timeline_q4k_gemv.py --out "$out" ${TIMELINE_SHAPES:+--shapes $TIMELINE_SHAPES} 2>&1 | grep -v Warn | tail -30 ;;
  stream)
    OUT="$out" timeout 300 python3 kernels/tools/stream_floor_cuda.py 2>&1 | grep -v Warn | tail -40 ;;
  attention)
    timeout 200 python3 kernels/tools/probe_decode_attention.py --out "$out" 2>&1 | grep -v Warn | cut -c1-600 ;;
  loop)
    timeout 570 python3 benchmarks/kernels_campaign.py --out "$out" --home /tmp/loom-kc ${LOOP_TASKS:+--tasks $LOOP_TASKS} 2>&1 \
      | grep -v "pairs,\|running [0-9]" | tail -60 ;;
  model)
    timeout 560 python3 -m kernels.llama_q4k.bench --random-config llama3-8b --gen 64 --runs 2 \
      --trace "$out/decode_trace.json" > "$out/llama3-8b.json" 2> "$out/llama3-8b.err"
    tail -c 3000 "$out/llama3-8b.json"; tail -5 "$out/llama3-8b.err"
    # where a decode step's time goes, kernel by kernel, by loom's own trace analysis
    python3 -c "import sys; from pathlib import Path; from loom_mcp.traces.analysis import analyze; \
a = analyze(Path(sys.argv[1])); [print(f'{k.time_us:10.1f} us {k.count:6d}x  {k.name[:90]}') for k in sorted(a.kernels, key=lambda k: -k.time_us)[:25]]" \
      "$out/decode_trace.json" 2>&1 | tee "$out/decode_kernels.txt" ;;
  vision)
    python3 -m kernels.layernorm.layernorm && python3 -m kernels.gelu.gelu
    timeout 200 python3 -m pytest -q -m gpu tests/test_vision.py 2>&1 | tail -5 | tee "$out/pytest_vision.txt"
    timeout 300 python3 benchmarks/vision_bench.py --runs 30 --batch 1 4 8 | tee "$out/vision_bench.json" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
done
pack
