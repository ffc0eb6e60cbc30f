#!/usr/bin/env bash
# Engine throughput of this working tree against an earlier commit, side by side in one run
# (the machine is noisy): `quantkit bench` alternates between the two, ROUNDS times each, and
# the ratio of the medians is printed. The earlier commit gets its own editable install in a
# throwaway virtual environment that borrows this one's dependencies (run it from this
# project's activated environment).
#
#   benchmarks/ab_bench.sh REV [ROUNDS] [-- extra quantkit bench arguments]
#   benchmarks/ab_bench.sh HEAD~1 3 -- --num-requests 32
#
# Defaults: smollm2-135m, 64 requests, prompts 32:512, outputs 16:256, bf16, one thread.
set -euo pipefail
rev=${1:?usage: benchmarks/ab_bench.sh REV [ROUNDS] [-- bench args]}
rounds=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
# shellcheck source=benchmarks/old_tree.sh
. "$(dirname "$0")/old_tree.sh"
old_tree "$rev"

args=(smollm2-135m --num-requests 64 --input-len 32:512 --output-len 16:256 --dtype bfloat16 "${extra[@]}")
run() {  # run NAME PYTHON: one bench, prints output tokens/s
  local json="$work/$1.json"
  # from $work: run from the repository, python would find this tree's quantkit/ first
  (cd "$work" && OMP_NUM_THREADS=1 "$2" -m quantkit.cli bench "${args[@]}" --json "$json" >/dev/null 2>&1)
  python -c "import json, sys; print(json.load(open(sys.argv[1]))['output_tokens_per_s'])" "$json"
}
new=() old=()
for i in $(seq "$rounds"); do
  new+=("$(run new python)")
  old+=("$(run old "$old_python")")
  echo "round $i: this tree ${new[-1]} tok/s, $rev ${old[-1]} tok/s"
done
python - "$rev" "${new[*]}" "${old[*]}" <<'EOF'
import statistics, sys
rev, new, old = sys.argv[1], [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
n, o = statistics.median(new), statistics.median(old)
print(f"median output tokens/s: this tree {n:.1f}, {rev} {o:.1f}, ratio {n / o:.3f}")
EOF
