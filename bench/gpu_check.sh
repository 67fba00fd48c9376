#!/usr/bin/env bash
# The GPU checks of the fused kernels in one go, sized for about 8 minutes on one H200 (at
# most about 10 by the timeouts below):
#   1. the CUDA tests (what make test-gpu runs: pytest -m cuda), fused kernels included;
#   2. bench-gpu, BERT-Large, bf16, LAMB and 1-bit LAMB, reference and fused kernels
#      alternating on one trainer per configuration (--impl reference,fused; the eager
#      invocation adds fused-separate: 1-bit LAMB's fused step with its fold and expansion
#      as passes of their own, as before the update read the messages): eager at
#      lengths 128 and 512 with the optimizers timed alone, then compiled at 128, then
#      compiled at 512 (three invocations, so that a late one running out of time keeps
#      the earlier figures); the compiled ones also profile 2 steps per implementation
#      (each row's profile: the step's time by category, its largest kernels); each
#      invocation's limit is its cap or what the plan leaves it, whichever is less, so
#      the time the CUDA tests leave goes to compiling;
#   3. LAMB with packed sequences (data.packing) beside padded rows, eager, both lengths,
#      in the time the others left (skipped with under 45 s).
# Usage: OUT=dir bash bench/gpu_check.sh   (PY: the Python to use; default: the project's
# .venv if there is one, else python3, e.g. a machine's own CUDA build of torch).
# Writes to $OUT (default runs/gpu_check): test-gpu.log, bench-*.json (the JSON line of each
# invocation), bench-*.rows.jsonl (its rows, written as each configuration finishes: kept
# when a time limit stops it), bench-*.log (its stderr), summary.md (bench/gpu_summary.py: the tables and
# the targets' verdicts); the prepared data goes to $DATA (default
# runs/gpu_check_data, reused when there). Exits non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT"
rm -f "$OUT"/bench-*.rows.jsonl  # appended to as rows finish: start them empty
status=0
started=$(date +%s)
say() { echo "gpu_check: $* ($(($(date +%s) - started)) s)" >&2; }

"$PY" -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu_check needs a CUDA GPU')" ||
    exit 1

say "CUDA tests"
timeout 210 "$PY" -m pytest -v -m cuda --durations=0 -p no:cacheprovider tests/test_gpu.py >"$OUT/test-gpu.log" 2>&1 ||
    status=1
tail -n 3 "$OUT/test-gpu.log" >&2

say "data at lengths 128 and 512"
DATA=${DATA:-runs/gpu_check_data}  # kept out of $OUT: only the results travel back
if [ ! -d "$DATA/seq512" ]; then
    "$PY" -c "import sys; from pathlib import Path; from bench.common import prepare_generated; \
prepare_generated(Path(sys.argv[1]), (128, 512))" "$DATA" >"$OUT/data.log" 2>&1 || status=1
fi

COMMON=(--prepared "$DATA" --precisions bf16 --optimizers lamb,onebit_lamb
    --no-hf-baseline --steps 6 --warmup-steps 4 --repeats 2)
# Each bench invocation's time limit: at most CAP seconds, and no more than leaves RESERVE
# seconds of the 570-second plan to the invocations after it. Time the CUDA tests did not
# use goes to the compiled invocations, whose compiling takes the longest.
limit() {
    local cap=$1 reserve=$2 left
    left=$((570 - ($(date +%s) - started) - reserve))
    echo $((left < cap ? left : cap))
}
bench() {
    local name=$1 seconds
    seconds=$(limit "$2" "$3")
    shift 3
    if [ "$seconds" -lt 30 ]; then  # (timeout 0 would mean no limit at all)
        say "bench $name skipped: ${seconds} s left for it"
        : >"$OUT/bench-$name.json"  # the summary names it as holding no result
        status=1
        return
    fi
    say "bench $name (limit $seconds s)"
    timeout "$seconds" "$PY" -m bench.gpu "${COMMON[@]}" "$@" --rows-out "$OUT/bench-$name.rows.jsonl" \
        >"$OUT/bench-$name.out" 2>"$OUT/bench-$name.log" || status=1
    tail -n 1 "$OUT/bench-$name.out" >"$OUT/bench-$name.json"
}
#     name          cap reserve
bench eager         120 230 --compile off --seq-lengths 128,512 --impl reference,fused,fused-separate
bench compiled-128  200 110 --compile on --seq-lengths 128 --impl reference,fused \
    --no-optimizer-steps --profile-steps 2
bench compiled-512  200   0 --compile on --seq-lengths 512 --impl reference,fused \
    --no-optimizer-steps --profile-steps 2
# packed sequences (data.packing) against padded rows, LAMB, eager, both lengths: in what
# is left of 570 s, so that the whole script stays inside a 10-minute call
left=$(limit 90 0)
if [ "$left" -ge 45 ]; then
    say "bench packing (limit ${left} s)"
    timeout "$left" "$PY" -m bench.gpu --prepared "$DATA" --precisions bf16 \
        --optimizers lamb --impl fused --no-hf-baseline --no-optimizer-steps --steps 6 \
        --warmup-steps 4 --repeats 1 --compile off --seq-lengths 128,512 --packing both \
        --rows-out "$OUT/bench-packing.rows.jsonl" >"$OUT/bench-packing.out" 2>"$OUT/bench-packing.log" || status=1
    tail -n 1 "$OUT/bench-packing.out" >"$OUT/bench-packing.json"
else
    say "bench packing skipped: ${left} s left"
fi
"$PY" -m bench.gpu_summary "$OUT" >"$OUT/summary.md" || status=1  # the tables, the targets
say "done, status $status"
exit $status
