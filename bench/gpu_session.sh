#!/usr/bin/env bash
# One call on a lent GPU machine: the measurements issue 37 waits for, in order of value, each
# with its own timeout, skipped when it would overrun BUDGET_S, with nvidia-smi sampled every
# second. Run from the checkout's root with starfed importable (PY, default python3):
#
#   OUT=/tmp/gpu-out bash bench/gpu_session.sh            # all steps, ≤ BUDGET_S (540 s)
#   STEPS="sim5 fits" bash bench/gpu_session.sh           # some of them
#
# Steps: sim5 (the 5-site paper-dims federation on the bundled set, local runtime — the issue's
# ≤ 40 s wall and ≥ 50 % busy), fits (bench/mixture_fit.py on cuda: batched fit vs scikit-learn
# at paper dims), speed (bench/speed.py units at paper dims), gputest (tests/test_gpu.py: the
# paper-dims federated step, the fit against scikit-learn, the prefetching copies), profile
# (bench/profile_units.py on cuda, Chrome traces), sim20 (20 sites on the one GPU). Writes
# OUT/steps.tsv (step, exit code, wall), OUT/summary.txt (per step: wall, mean GPU busy %, peak
# GPU memory, and the FAA of a run), the logs, gpu.csv and results.tgz. Numbers go to
# bench/results/gpu_kept_busy.md and their summary to docs/benchmarks.md ("The GPU kept busy").
set -u
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-out}
BUDGET_S=${BUDGET_S:-540}
STEPS=${STEPS:-sim5 fits speed gputest profile sim20}
R=$OUT/results
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
  FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 RAY_USAGE_STATS_ENABLED=0 \
  FLWR_HOME=${FLWR_HOME:-$(mktemp -d)}

{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/device.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
  -lms 1000 > "$OUT/gpu.csv" 2>/dev/null &
smi=$!

limit() {  # the step's timeout in seconds
  case $1 in
    sim5) echo 150 ;; fits) echo 60 ;; speed) echo 120 ;; gputest) echo 150 ;;
    profile) echo 90 ;; sim20) echo 200 ;; *) echo 0 ;;
  esac
}

start_all=$(date +%s)
printf 'step\texit\tstart\tend\n' > "$OUT/steps.tsv"
for step in $STEPS; do
  t=$(limit "$step")
  used=$(( $(date +%s) - start_all ))
  if [ "$t" = 0 ]; then echo "unknown step $step" >&2; continue; fi
  if [ $(( used + t )) -gt "$BUDGET_S" ]; then echo "skipped $step (budget)" | tee -a "$OUT/summary.txt"; continue; fi
  s=$(date +%s.%N)
  case $step in
    sim5 | sim20)  # the paper-dims federation on the bundled 7 tasks x 4 classes
      timeout "$t" $PY -m starfed.cli simulate --runtime local --sites "${step#sim}" \
        --results-dir "$R" --run-name "$step" --run-config preset=paper-random \
        --run-config device=cuda ;;
    fits) timeout "$t" $PY bench/mixture_fit.py --device cuda --dims T,paper --repeats 5 \
            --steps 0 --threads 8 --json "$OUT/fits.json" ;;
    speed) timeout "$t" $PY bench/speed.py --device cuda --dims paper --repeats 3 --threads 8 \
             --json "$OUT/speed.json" ;;
    gputest) timeout "$t" $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
    profile) timeout "$t" $PY bench/profile_units.py --device cuda --dims paper --batch 128 \
               --threads 8 --units stage2,inference,stage1_cached --trace-dir "$OUT/traces" \
               --json "$OUT/profile.json" ;;
  esac > "$OUT/$step.log" 2>&1
  code=$?
  printf '%s\t%s\t%s\t%s\n' "$step" "$code" "$s" "$(date +%s.%N)" >> "$OUT/steps.tsv"
  echo "$step: exit $code"
done
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null

$PY - "$OUT" "$R" >> "$OUT/summary.txt" <<'EOF'
"""Per step: wall, mean GPU busy and peak GPU memory over its seconds; a run's FAA."""
import csv, datetime, json, pathlib, sys
out, results = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
samples = []
for row in csv.reader((out / "gpu.csv").read_text().splitlines()):
    try:
        when = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((when, float(row[1]), float(row[2])))
    except (ValueError, IndexError):
        continue
for step in csv.DictReader((out / "steps.tsv").open(), delimiter="\t"):
    start, end = float(step["start"]), float(step["end"])
    inside = [(busy, mem) for when, busy, mem in samples if start <= when <= end]
    busy = sum(b for b, _ in inside) / len(inside) if inside else float("nan")
    peak = max((m for _, m in inside), default=float("nan"))
    line = f"{step['step']}: exit {step['exit']}, {end - start:.1f} s, GPU busy {busy:.0f} %, peak {peak:.0f} MiB"
    metrics = results / step["step"] / "metrics.json"
    if metrics.is_file():
        m = json.loads(metrics.read_text())
        line += f", FAA {m.get('final_average_accuracy')}, run wall {m.get('wall_time_s')}"
    print(line)
EOF
cat "$OUT/summary.txt"
tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null
