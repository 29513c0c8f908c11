#!/usr/bin/env bash
# The commands behind the README's "Results" tables (CPU, 2 threads). Run from the repository root:
#
#   results/run_benchmarks.sh keyphrase                   # all four decoders trained, built-in keyphrase
#   results/run_benchmarks.sh keyphrase-rescore S P B N   # re-score + re-time those four checkpoints
#   results/run_benchmarks.sh nar S                       # NAR trained again, sequential reused
#   results/run_benchmarks.sh summarization               # sequential, pipelined, blockwise trained
#   results/run_benchmarks.sh qa                          # the same on built-in multi-span QA
#
# Every run trains with the same default budget (t5-tiny, 10 epochs, seed 42) and times the decoders
# interleaved on the first 100 test examples (median of 3 passes after a warm-up). S P B N are
# checkpoints (mlruns/artifacts/<run id>/checkpoints/<file>.ckpt; the run ids are in the JSON) of the
# sequential, pipelined, blockwise and NAR models. `keyphrase-rescore` exists because the first
# `keyphrase` run tested NAR with its epoch-0 checkpoint; `nar` exists because the re-score did too:
# until commit 1fa080c, last.ckpt was only refreshed together with the best checkpoint (Lightning
# 2.6's save_last), so a model whose validation F1 never rose above 0 was tested at epoch 0.
set -euo pipefail
SPEED="--speed-examples 100 --repeats 3 --threads 2 eval.batch_size=16 trainer.enable_progress_bar=false"
SWEEP="--sweep decoder.iterations=1,2,4,10"
case "${1:-}" in
    keyphrase)
        python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar $SWEEP \
            $SPEED --out results/builtin_keyphrase_trained.json ;;
    keyphrase-rescore)
        python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar $SWEEP \
            $SPEED --out results/builtin_keyphrase.json \
            --ckpt "sequential=$2" --ckpt "pipelined=$3" --ckpt "blockwise=$4" --ckpt "nar=$5" ;;
    nar)
        python -m tasks.compare --task keyphrase --decoders sequential,nar $SWEEP $SPEED \
            --ckpt "sequential=$2" --out results/builtin_keyphrase_nar.json ;;
    summarization | qa)
        python -m tasks.compare --task "$1" --decoders sequential,pipelined,blockwise $SPEED \
            --out "results/builtin_$1.json" ;;
    *)
        echo "usage: $0 keyphrase | keyphrase-rescore S P B N | nar S | summarization | qa" >&2
        exit 2 ;;
esac
