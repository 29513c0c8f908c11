#!/usr/bin/env bash
# The commands behind results/gpu/: the paper's comparison on a CUDA device, from the repo root.
# On a machine without CUDA the same commands run on the CPU, and every table they
# write says that its figures are CPU figures, not GPU figures.
#
#   tasks/bench/run_gpu_benchmarks.sh fit TASK     # t5-small-sized models from random weights on the
#                                                  # task's built-in data, at its default budget:
#                                                  # sequential, pipelined and nar, then blockwise heads
#                                                  # on the frozen sequential model
#   tasks/bench/run_gpu_benchmarks.sh bench TASK   # on those checkpoints, at batch sizes 1 and 64, in
#                                                  # fp32 and in bf16: tasks.bench.gpu_benchmark (six
#                                                  # decoders; lookup and aggressive decode the sequential
#                                                  # model, aggressive drafting with the nar one) and
#                                                  # tasks.bench.peers (transformers' fast paths)
#   tasks/bench/run_gpu_benchmarks.sh decode TASK  # the first half of bench: gpu_benchmark alone
#   tasks/bench/run_gpu_benchmarks.sh peers TASK   # the second half: peers alone
#   tasks/bench/run_gpu_benchmarks.sh builtin TASK...  # fit every TASK at once (the fits share the
#                                                  # device), then bench each alone
#   tasks/bench/run_gpu_benchmarks.sh all [SECONDS]  # the whole comparison in one command, within
#                                                  # SECONDS (default 540): `python -m pytest -m cuda`
#                                                  # beside the fits of every built-in task at once,
#                                                  # at the shorter budgets of `all_budget`, both
#                                                  # stopped at $FIT_SHARE percent of SECONDS (default
#                                                  # 45); the fits' table (tasks.bench.gpu_fits); then
#                                                  # each benchmark alone, every task in turn: decode
#                                                  # and peers in fp32, then both in bf16, then peers
#                                                  # with the compiled steps on keyphrase, each under
#                                                  # the time left (one with less than $LEAST seconds
#                                                  # left, default 20, is skipped and named so)
#
# Checkpoints and MLflow runs go under $RUNS (default mlruns/gpu), one store per fit, beside its log
# (fit.log) and its wall-clock seconds (fit_seconds); the tables go to $RESULTS (default
# results/gpu). The timings run one at a time, with nothing else on the device, on the first
# $EXAMPLES test examples (default 64; batch size 1 on the first $SINGLE of them, default 16; `all`:
# 8), the median of $REPEATS interleaved passes (default 3), in each precision of $PRECISIONS
# (default "fp32 bf16"). $FIT_OVERRIDES (key=value ...) is added to every fit (a quick check of the
# script: a smaller model and budget).
set -euo pipefail
RUNS=${RUNS:-mlruns/gpu}
RESULTS=${RESULTS:-results/gpu}
EXAMPLES=${EXAMPLES:-64}
SINGLE=${SINGLE:-}   # default 16; `all`: 8
REPEATS=${REPEATS:-3}
PRECISIONS=${PRECISIONS:-fp32 bf16}
LEAST=${LEAST:-20}
# peers' optional rows: compiled sequential and pipelined, CTranslate2 (needs pip install -e ".[bench]")
PEERS_ROWS=${PEERS_ROWS:---compiled --ctranslate2}
# t5-small's shape (Raffel et al.), from random weights, with the library's locally trained tokenizer
SMALL="model.d_model=512 model.d_ff=2048 model.d_kv=64 model.num_heads=8 model.num_layers=6
       model.num_decoder_layers=6 model.lr=${LR:-5e-4}"
QUIET="trainer.enable_progress_bar=false eval.batch_size=64"

limited_until() {  # [DEADLINE]: the command prefix that stops a command at $SECONDS = DEADLINE
                   # (`timeout`, which stops its whole process group); none without a deadline
    if [[ -n ${1:-} ]]; then echo "timeout -k 10 $(($1 - SECONDS > 1 ? $1 - SECONDS : 1))"; fi
}

fit_one() {  # TASK DECODER [key=value ...]: one fit into its own store under $RUNS/TASK/DECODER
    local task=$1 decoder=$2; shift 2
    local home="$RUNS/$task/$decoder"
    mkdir -p "$home"
    local started=$SECONDS
    $(limited_until "${FITS_UNTIL:-}") python -m tasks.fit --task "$task" --decoder "$decoder" $SMALL $QUIET ${FIT_OVERRIDES:-} \
        tracking.uri="sqlite:///$home/mlflow.db" tracking.artifact_location="$home/artifacts" \
        data.tokenizer_cache="$home/tokenizer" "$@" > "$home/fit.log" 2>&1
    echo $((SECONDS - started)) > "$home/fit_seconds"
}

checkpoint() {  # TASK DECODER: the tested (best) checkpoint of that fit
    ls "$RUNS/$1/$2"/artifacts/*/checkpoints/epoch*.ckpt
}

fit_task() {
    local task=$1
    fit_one "$task" pipelined & local pipelined=$!
    fit_one "$task" nar & local nar=$!
    fit_one "$task" sequential
    fit_one "$task" blockwise train.init_from="$(checkpoint "$task" sequential)" \
        decoder.freeze_backbone=true
    wait $pipelined $nar
}

checkpoints() {  # TASK: the sequential, pipelined, blockwise and nar checkpoints, in that order
    local decoder
    for decoder in sequential pipelined blockwise nar; do checkpoint "$1" $decoder; done
}

decode_task() {  # gpu_benchmark in each precision; all run, and it fails at the end if either did
    local task=$1 s p b n precision failed=0
    read -r s p b n <<< "$(checkpoints "$task" | tr '\n' ' ')"
    mkdir -p "$RESULTS"
    for precision in $PRECISIONS; do
        ${LIMIT:-} python -m tasks.bench.gpu_benchmark --ckpt sequential="$s" --ckpt pipelined="$p" \
            --ckpt blockwise="$b" --ckpt nar="$n" --ckpt lookup="$s" --ckpt aggressive="$s" \
            --drafter "$n" --batch-sizes 1,64 --precision $precision --repeats "$REPEATS" \
            --examples "$EXAMPLES" --single-examples "${SINGLE:-16}" \
            --out "$RESULTS/builtin_${task}_$precision.json" || failed=1
    done
    return $failed
}

peers_task() {  # tasks.bench.peers in each precision, likewise
    local task=$1 s p b n precision failed=0
    read -r s p b n <<< "$(checkpoints "$task" | tr '\n' ' ')"
    mkdir -p "$RESULTS"
    for precision in $PRECISIONS; do
        ${LIMIT:-} python -m tasks.bench.peers --ckpt "$s" --blockwise "$b" --pipelined "$p" $PEERS_ROWS \
            --batch-size 64 --precision $precision --repeats "$REPEATS" --examples "$EXAMPLES" \
            --single-examples "${SINGLE:-16}" \
            --out "$RESULTS/peers_${task}_$precision${PEERS_NAMED:-}.json" || failed=1
    done
    return $failed
}

bench_task() {  # both halves; both run, and it fails at the end if either did
    local failed=0
    decode_task "$1" || failed=1
    peers_task "$1" || failed=1
    return $failed
}

TASKS="keyphrase summarization qa"

all_budget() {  # TASK: its fits' budget in `all`, shorter than the defaults so that every fit and
                # benchmark runs within `all`'s time (QA's best validation score came after its
                # first epoch at the defaults on an H200: results/gpu/fits_h200.md)
    case $1 in
        qa) echo "trainer.max_epochs=1" ;;
        *) echo "trainer.max_epochs=4" ;;
    esac
}

all_tasks() {  # [SECONDS]: see the top of this file
    local deadline=$((SECONDS + ${1:-540})) engine="" task tests pid pids=() failed=0
    local steps=() step kind precision left
    SINGLE=${SINGLE:-8}
    # the fits and the tests beside them stop at their share of the time, the benchmarks at the end
    FITS_UNTIL=$((SECONDS + ${1:-540} * ${FIT_SHARE:-45} / 100))
    if python -c "import ctranslate2" 2> /dev/null; then engine=--ctranslate2
    else echo "ctranslate2 is not installed: the peers tables have no CTranslate2 rows"; fi
    mkdir -p "$RUNS" "$RESULTS"
    $(limited_until $FITS_UNTIL) python -m pytest -q -m cuda -p no:cacheprovider \
        > "$RUNS/cuda_tests.log" 2>&1 & tests=$!
    for task in $TASKS; do
        FIT_OVERRIDES="$(all_budget $task) ${FIT_OVERRIDES:-}" fit_task "$task" & pids+=($!)
    done
    echo "[${SECONDS}s] fitting every task, the cuda tests beside the fits"
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    wait $tests || { echo "the cuda tests failed or ran out of time: $RUNS/cuda_tests.log"; failed=1; }
    echo "[${SECONDS}s] fits and tests done: $(tail -n 1 "$RUNS/cuda_tests.log")"
    python -m tasks.bench.gpu_fits "$RUNS" --out "$RESULTS/fits.json" || failed=1
    for precision in fp32 bf16; do
        for kind in decode peers; do
            for task in $TASKS; do steps+=("$kind $task $precision"); done
        done
    done
    # last, where time is left: the compiled steps beside the eager ones (compiling each shape
    # takes seconds), on keyphrase in fp32
    steps+=("compiled keyphrase fp32")
    for step in "${steps[@]}"; do
        read -r kind task precision <<< "$step"
        left=$((deadline - SECONDS))
        if ((left < LEAST)); then
            echo "skipped, out of time: $step"; failed=1; continue
        fi
        echo "[${SECONDS}s] $step"
        case $kind in
            decode) PRECISIONS=$precision LIMIT=$(limited_until $deadline) decode_task "$task" ;;
            peers) PRECISIONS=$precision PEERS_ROWS=$engine LIMIT=$(limited_until $deadline) \
                       peers_task "$task" ;;
            compiled) PRECISIONS=$precision PEERS_ROWS="--compiled $engine" PEERS_NAMED=_compiled \
                          LIMIT=$(limited_until $deadline) peers_task "$task" ;;
        esac || failed=1
    done
    echo "[${SECONDS}s] done"
    return $failed
}

case "${1:-}" in
    fit) fit_task "$2" ;;
    decode) decode_task "$2" ;;
    peers) peers_task "$2" ;;
    bench) bench_task "$2" ;;
    builtin)
        shift
        pids=()
        for task in "$@"; do fit_task "$task" & pids+=($!); done
        wait "${pids[@]}"
        for task in "$@"; do bench_task "$task"; done ;;
    all) all_tasks "${2:-}" ;;
    *) sed -n '2,37p' "$0"; exit 2 ;;
esac
