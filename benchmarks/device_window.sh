#!/usr/bin/env bash
# One device call: starts a chain of suites (benchmarks/device_chain_issue60.sh, say) once, in a process session of
# its own so that it outlives the call, waits up to WAIT_S or until it ends, and brings back what it has done so far
# ($OUT/chain.tgz and the step log): a chain longer than one call's 600 s, with one set-up, on one held machine.
set -u
# bash .gpu/tree/benchmarks/device_window.sh WAIT_S CHAIN [SKIP]: call again with the same arguments, within the
# machine's 30 s of warmth, to wait for the rest; SKIP: steps done on an earlier machine (comma-separated).
chain=$2 skip=${3:-}
G=$PWD/.gpu C=/tmp/chain
if [ ! -e $C/steps.txt ]; then
  mkdir -p $C && echo "[$(date +%T)] chain on $(nvidia-smi --query-gpu=name --format=csv,noheader)" > $C/steps.txt
  SKIP=$skip setsid nohup bash "$chain" $G > $C/chain.log 2>&1 < /dev/null &
fi
end=$((SECONDS + $1))
while ! grep -q ALL $C/steps.txt && [ $SECONDS -lt $end ]; do sleep 3; done
tar -C $C --exclude='*-ray-logs.tgz' -czf $OUT/chain.tgz . 2>/dev/null; cp $C/defaults-ray-logs.tgz $OUT/ 2>/dev/null
cat $C/steps.txt; tail -5 $C/*.txt 2>/dev/null | cut -c1-300 | tail -60
