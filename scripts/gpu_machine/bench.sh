# On the GPU machine (device tool, carry [".gpuros"]), from the repository root:
#   bash scripts/gpu_machine/bench.sh NAME SECONDS BENCH-ARGS...
# runs `python3 -m robot_offload.bench BENCH-ARGS --out /tmp/r/NAME` for at most SECONDS,
# prints the results table and leaves $OUT/NAME.tgz (report, frames, rows, logs).
source scripts/gpu_machine/env.sh
name=$1; secs=$2; shift 2
mkdir -p /tmp/r
timeout "$secs" python3 -m robot_offload.bench "$@" --out "/tmp/r/$name" 2>&1 | tr '\r' '\n' | grep -v 'run/s\]$' | tail -20
sed -n '/## Results/,/## Physical/p' "/tmp/r/$name/report.md" 2>/dev/null
tar czf "$OUT/$name.tgz" -C /tmp/r "$name"
