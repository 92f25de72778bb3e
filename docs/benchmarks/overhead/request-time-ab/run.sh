set -x
cd /tmp/ab3
for r in 1 2; do
  for v in old new; do
    if [ $v = old ]; then export PYTHONPATH=/tmp/oldtree2; else unset PYTHONPATH; fi
    date -u
    flock /tmp/floodgate-bench.lock /work/main/.venv/bin/floodgate bench overhead --duration 6 --rounds 1 --connections 1 16 --configs noop floodgate floodgate-picking --json /tmp/ab3/$v$r.json > /tmp/ab3/$v$r.txt 2>&1
    uptime
  done
done
