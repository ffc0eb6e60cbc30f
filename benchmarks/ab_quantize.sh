#!/usr/bin/env bash
# Quantization of this working tree against an earlier commit, side by side in one run: for
# each method, both trees quantize the same model with the same arguments (alternating which
# goes first), and the script prints both wall times, their ratio, and whether the
# checkpoints' tensors and config.json are byte-identical.
#
#   benchmarks/ab_quantize.sh REV [METHODS] [-- extra quantize arguments]
#   benchmarks/ab_quantize.sh 50d814f "awq gptq" -- --samples 64
#
# Defaults: awq and gptq on smollm2-135m, w4a16-asym, group 64, news 64 × 512 (the quick start).
set -euo pipefail
rev=${1:?usage: benchmarks/ab_quantize.sh REV [METHODS] [-- quantize args]}
methods=${2:-awq gptq}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
# shellcheck source=benchmarks/old_tree.sh
. "$(dirname "$0")/old_tree.sh"
old_tree "$rev"

args=(--model smollm2-135m --scheme w4a16-asym --group-size 64 --calib news --samples 64 "${extra[@]}")
run() {  # run NAME PYTHON METHOD: one quantization, prints its wall seconds
  local start end
  start=$(date +%s.%N)
  (cd "$work" && "$2" -m quantkit.cli "$3" "${args[@]}" -o "$work/$1-$3" >/dev/null 2>&1)
  end=$(date +%s.%N)
  python -c "print(f'{$end - $start:.1f}')"
}
i=0
for m in $methods; do
  if (( i++ % 2 )); then old=$(run old "$old_python" "$m"); new=$(run new python "$m")
  else new=$(run new python "$m"); old=$(run old "$old_python" "$m"); fi
  same=identical
  for f in config.json $(cd "$work/new-$m" && ls ./*.safetensors ./*.index.json 2>/dev/null); do
    cmp -s "$work/new-$m/$f" "$work/old-$m/$f" || same="DIFFERENT ($f)"
  done
  python -c "print(f'$m: this tree $new s, $rev $old s, ratio {$new / $old:.3f}; checkpoints $same')"
done
