set -x
for r in new1 old1 new2 old2; do
  case $r in new*) PP=/work/main;; old*) PP=/tmp/abold;; esac
  PYTHONPATH=$PP flock /tmp/floodgate-bench.lock /work/main/.venv/bin/floodgate bench overhead --configs noop floodgate-sampled floodgate-picking --connections 16 64 --rounds 2 --duration 8 --json /tmp/ovab/$r.json > /tmp/ovab/$r.log 2>&1
done
echo done > /tmp/ovab/done
