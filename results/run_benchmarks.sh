#!/usr/bin/env bash
# The commands behind the README's "Results" tables (CPU, 2 threads). Run from the repository root
# with ../shared/data present. Each line trains every decoder with the same budget, then times them
# side by side in one process.
set -euo pipefail
COMMON="--repeats 3 --threads 2 eval.batch_size=16 trainer.enable_progress_bar=false"
python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar \
    --sweep decoder.iterations=1,2,4,10 --speed-examples 100 --out results/builtin_keyphrase.json $COMMON
python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar \
    --sweep decoder.iterations=1,2,4,10 --speed-examples 100 --out results/kp20k.json $COMMON \
    data=jsonl data.path=../shared/data/kp20k data.max_eval_examples=200
python -m tasks.compare --task summarization --decoders sequential,pipelined \
    --speed-examples 50 --out results/cnndm.json $COMMON \
    data=jsonl data.path=../shared/data/cnndm data.max_train_examples=2000 data.max_eval_examples=100 \
    data.max_source_length=384 data.max_target_length=128 decoder.max_subsequence_length=48 trainer.max_epochs=6
