#!/usr/bin/env bash
# Fuzz mha_ext with tests/fuzz/fuzz_mha.py, the last phase under AddressSanitizer
# and UndefinedBehaviorSanitizer.
#
#   tests/fuzz/run.sh [SECONDS] [CORPUS_DIR]        (default 30 s, tests/fuzz/corpus)
#
# Phase 1 (SECONDS/2): atheris, coverage-guided on the Python code, with the
#   plain build of mha_ext that `python` imports -- it grows the corpus.
# Phase 2 (SECONDS): the same harness with the sanitizer build preloaded
#   (libasan): every corpus input is replayed, then mutated further.  Under a
#   preloaded libasan atheris' coverage feedback is lost (libasan provides the
#   coverage symbols), which is why phase 1 runs first.
# The sanitizer build is $MHA_ASAN_BUILD (a source tree with mha_ext/_core*.so
# built in place with the sanitizer flags), or is built here in a copy.
# Without atheris both phases run the harness's --random mode.
# Prints "fuzz executions: N" and exits non-zero on any crash or report.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SECONDS_TOTAL="${1:-30}"
CORPUS="${2:-$HERE/corpus}"
PY="${PYTHON:-python}"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -fno-wrapv"
mkdir -p "$CORPUS"

if [ -z "${MHA_ASAN_BUILD:-}" ]; then
    MHA_ASAN_BUILD="$(mktemp -d)/mha-asan"
    mkdir -p "$MHA_ASAN_BUILD"
    (cd "$ROOT" && tar cf - setup.py pyproject.toml README.md MANIFEST.in src mha_ext \
        --exclude='*.so' --exclude=__pycache__) | (cd "$MHA_ASAN_BUILD" && tar xf -)
    (cd "$MHA_ASAN_BUILD" && MHA_EXT_CFLAGS="$SAN" "$PY" setup.py -q build_ext --inplace >/dev/null)
fi

# phase 1 imports the installed mha_ext, or else an in-place build in the tree
(cd "$HERE" && "$PY" -c "import mha_ext._core") 2>/dev/null \
    || export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MODE=()
"$PY" -c "import atheris" 2>/dev/null || { echo "atheris not installed: random mode"; MODE=(--random); }
LOG="$(mktemp)"
half=$(( SECONDS_TOTAL / 2 > 1 ? SECONDS_TOTAL / 2 : 1 ))
FLAGS=(-timeout=60 -rss_limit_mb=8192 -print_final_stats=0)
[ ${#MODE[@]} -eq 0 ] || FLAGS=()

echo "== fuzz phase 1: ${half}s, plain build, coverage-guided"
(cd "$ROOT" && "$PY" "$HERE/fuzz_mha.py" "${MODE[@]}" "${FLAGS[@]}" -max_total_time="$half" \
    "$CORPUS" 2>&1 | tee "$LOG.1" | grep -E "^(fuzzing|INFO: Seed|#[0-9]+ +(INITED|DONE)|Done)" || true)
grep -q "^Done [0-9]* runs" "$LOG.1" || { tail -60 "$LOG.1"; echo "fuzz phase 1 FAILED"; exit 1; }

echo "== fuzz phase 2: ${SECONDS_TOTAL}s under ASan+UBSan ($MHA_ASAN_BUILD)"
(cd "$MHA_ASAN_BUILD" && \
    LD_PRELOAD="$(gcc -print-file-name=libasan.so)" \
    ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" PYTHONPATH="$MHA_ASAN_BUILD" \
    "$PY" "$HERE/fuzz_mha.py" "${MODE[@]}" "${FLAGS[@]}" -max_total_time="$SECONDS_TOTAL" \
    "$CORPUS" 2>&1 | tee "$LOG.2" | grep -E "^(fuzzing|INFO: Seed|#[0-9]+ +(INITED|DONE)|Done)" || true)
if grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: libFuzzer|Traceback" "$LOG.2" \
        || ! grep -q "^Done [0-9]* runs" "$LOG.2"; then
    tail -80 "$LOG.2"
    echo "fuzz phase 2 FAILED (crash inputs, if any, are in $MHA_ASAN_BUILD)"
    exit 1
fi
n1=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$LOG.1" | tail -1)
n2=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$LOG.2" | tail -1)
echo "fuzz executions: $((n1 + n2)) ($n1 plain, $n2 under ASan+UBSan); corpus: $(ls "$CORPUS" | wc -l) inputs"
