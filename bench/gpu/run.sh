#!/usr/bin/env bash
# The GPU check on a machine with a CUDA device, in a folder bench/gpu/prepare.py made:
#   bash run.sh [check] [memcheck] [kernels]      (default: all three)
# check:    every .pib against the interpreter and the emulated GPU, op times, picc bench (check.py)
# memcheck: every kernel alone under compute-sanitizer, one process per kernel, 8 at a time (unit.py)
# kernels:  the fused FFN kernels against cuBLAS and torch (kernels.py)
# Logs and JSON go to $OUT (default: this folder). Exit status: non-zero when a part failed.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
export OUT="${OUT:-$here}" PYTHONUNBUFFERED=1 PYTHONPATH="$here/src"
python="${PYTHON:-python3}"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(check memcheck kernels)
status=0
for part in "${parts[@]}"; do
    case "$part" in
    check)
        # shellcheck disable=SC2086
        "$python" check.py ${CHECK_ARGS:-} 2>&1 | tee "$OUT/check.log" || status=1
        ;;
    memcheck)
        sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
        if [ -z "$sanitizer" ]; then
            echo "memcheck: compute-sanitizer not found" | tee "$OUT/memcheck.log"; status=1; continue
        fi
        "$python" -c 'import json; print("\n".join(json.load(open("units/units.json"))))' |
            xargs -P 8 -I{} sh -c "'$sanitizer' --tool memcheck --error-exitcode 9 --print-limit 4 '$python' unit.py {} \
                > 'memcheck.{}.log' 2>&1; echo \"{} exit \$?\"" > "$OUT/memcheck.status"
        cat memcheck.*.log > "$OUT/memcheck.log"
        rm -f memcheck.*.log
        total=$(wc -l < "$OUT/memcheck.status")
        bad=$(grep -vc " exit 0$" "$OUT/memcheck.status")
        errors=$(grep -h "ERROR SUMMARY" "$OUT/memcheck.log" | awk '{s += $4} END {print s + 0}')
        echo "memcheck: $total kernels alone, $bad with a non-zero exit, $errors errors in all"
        grep -v " exit 0$" "$OUT/memcheck.status" | head -20
        grep -h "DIFFERS\|ERROR\|Error\|Traceback" "$OUT/memcheck.log" | grep -v "ERROR SUMMARY: 0" | head -20
        [ "$bad" = 0 ] || status=1
        ;;
    kernels)
        "$python" kernels.py 2>&1 | tee "$OUT/kernels.log" || status=1
        ;;
    *)
        echo "run.sh: unknown part '$part' (check, memcheck, kernels)" >&2; exit 2
        ;;
    esac
done
exit $status
