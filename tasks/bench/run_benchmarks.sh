#!/usr/bin/env bash
# The commands behind the tables in results/ (CPU; THREADS=N sets the torch threads, default 2).
# Run from the repository root. The real-text entries read JSONL folders (the library's schema)
# under DATA: $DATA/kp20k, $DATA/cnndm, $DATA/pubmed, $DATA/multispanqa.
#
#   tasks/bench/run_benchmarks.sh keyphrase          # every decoder on built-in keyphrase data: sequential,
#                                                # pipelined, blockwise (heads on the frozen sequential
#                                                # model), nar trained; lookup and aggressive decode the
#                                                # sequential model, aggressive drafting with the nar one
#   tasks/bench/run_benchmarks.sh summarization      # the same on built-in summarization
#   tasks/bench/run_benchmarks.sh qa                 # the same on built-in multi-span QA
#   tasks/bench/run_benchmarks.sh family TASK TYPE   # the same on built-in TASK with a model of another
#                                                # family built here: TYPE = bart, mbart, pegasus, marian
#   tasks/bench/run_benchmarks.sh kp20k              # all four decoders trained on $DATA/kp20k
#   tasks/bench/run_benchmarks.sh cnndm-calls        # decoder calls the cnndm test references need (no training)
#   tasks/bench/run_benchmarks.sh cnndm-baselines    # ROUGE of the summarization baselines on cnndm (no training)
#   tasks/bench/run_benchmarks.sh cnndm              # real text: sequential, pipelined, blockwise trained on
#                                                # $DATA/cnndm, 35 minutes of training per decoder
#   tasks/bench/run_benchmarks.sh pretrain           # tasks.experiments.pretrain on the four $DATA text folders
#   tasks/bench/run_benchmarks.sh kp20k-pretrained C # sequential and pipelined fitted on kp20k from
#                                                # pretrained checkpoint C (train.init_from)
#   tasks/bench/run_benchmarks.sh delay-sweep TASK [S] # the paper's delay study: one pipelined model per
#                                                # delay 1-4 on built-in TASK data, with quality and
#                                                # speedup against delay (*_vs_delay.png)
#   tasks/bench/run_benchmarks.sh delay2 S           # pipelined with delay 2 against sequential checkpoint S
#   tasks/bench/run_benchmarks.sh blockwise-frozen S # blockwise heads trained on sequential checkpoint S,
#                                                # its backbone frozen (train.init_from)
#   tasks/bench/run_benchmarks.sh nar-distilled S    # NAR trained on distilled data; S = the sequential
#                                                # checkpoint of the keyphrase step (its teacher)
#   tasks/bench/run_benchmarks.sh aggressive-drafter TASK S # fit aggressive's drafter on sequential
#                                                # checkpoint S of built-in TASK: a nar model on S's outputs
#                                                # for 10,000 sources, from S's weights, its encoder frozen
#   tasks/bench/run_benchmarks.sh aggressive-distilled TASK S N # aggressive on S with that drafter N,
#                                                # beside sequential (decode-only, one thread)
#   tasks/bench/run_benchmarks.sh onestep TASK S     # the one-call decoders (nar with 1 iteration, onestep
#                                                # on S's frozen backbone) beside sequential checkpoint S
#   tasks/bench/run_benchmarks.sh prototokens TASK S # Mezentsev & Oseledets' proto-token experiment on S
#                                                # (CPU-sized: 8 texts, 2 restarts, 1000 iterations)
#   tasks/bench/run_benchmarks.sh stop-rule TASK S P # pipelined checkpoint P decoded under both stopping
#                                                # rules beside sequential checkpoint S (no training)
#   tasks/bench/run_benchmarks.sh drafts NAME TASK S P B N [key=value ...]
#                                                # lookup and aggressive beside sequential, pipelined,
#                                                # blockwise and nar on checkpoints S P B N of TASK (no
#                                                # training; key=value: the data they were fitted on)
#   tasks/bench/run_benchmarks.sh peers TASK S B P   # transformers' greedy generate and prompt lookup beside
#                                                # this library's sequential (eager and compiled), lookup
#                                                # and blockwise and CTranslate2's greedy (needs ".[bench]"),
#                                                # on sequential checkpoint S and blockwise checkpoint B of TASK,
#                                                # and pipelined on pipelined checkpoint P of TASK
#   tasks/bench/run_benchmarks.sh multispanqa-fit    # sequential, pipelined, blockwise, nar fitted on
#                                                # $DATA/multispanqa (their checkpoints, for drafts)
#
# Every run trains with its task's default budget (t5-tiny, seed 42; configs/task/*.yaml) and times
# the decoders interleaved on the first 100 test examples (3 passes after a warm-up; the median and
# the spread of the passes are reported). Blockwise trains
# its heads on the sequential row's tested checkpoint, backbone frozen (tasks.compare's default when
# sequential is compared; its table's `training` column says so). Checkpoints are in
# mlruns/artifacts/<run id>/checkpoints/; each run's `tested_checkpoint` tag names the one tested.
set -euo pipefail
case "${1:-}" in  # the real-text entries
    kp20k | cnndm* | pretrain | kp20k-pretrained | multispanqa-fit)
        : "${DATA:?set DATA to the folder that holds the JSONL folders kp20k/, cnndm/, pubmed/, multispanqa/}" ;;
esac
SPEED="--speed-examples 100 --repeats 3 --threads ${THREADS:-2} eval.batch_size=16 trainer.enable_progress_bar=false"
SWEEP="--sweep decoder.iterations=1,2,4,10"
case "${1:-}" in
    keyphrase | summarization | qa)  # every decoder on the task's built-in data, at its default budget
        python -m tasks.compare --task "$1" --decoders sequential,pipelined,blockwise,nar,lookup,aggressive \
            $SPEED --out "results/builtin_$1.json" ;;
    family)  # TASK TYPE: every decoder on built-in TASK with model=TYPE-tiny, at the task's budget
        python -m tasks.compare --task "$2" --decoders sequential,pipelined,blockwise,nar,lookup,aggressive \
            "model=$3-tiny" $SPEED --out "results/builtin_$2_$3.json" ;;
    kp20k)
        python -m tasks.compare --task keyphrase --decoders sequential,pipelined,blockwise,nar $SWEEP \
            $SPEED data=jsonl data.path="$DATA/kp20k" data.max_eval_examples=200 \
            --out results/kp20k.json ;;
    cnndm-calls)  # long limits: no reference is cut
        python -m tasks.experiments.reference_calls --task summarization --decoders sequential,pipelined,nar \
            --sweep decoder.delay=1,2 data=jsonl data.path="$DATA/cnndm" \
            data.max_target_length=1024 data.max_subsequences=64 --out results/cnndm_reference_calls.json ;;
    cnndm-baselines)
        python -m tasks.experiments.baselines --task summarization data=jsonl data.path="$DATA/cnndm" \
            --out results/cnndm_baselines.json ;;
    cnndm)  # cnndm.yaml's limits (data=jsonl gets the defaults), source cut to 320 tokens, a time budget
        python -m tasks.compare --task summarization --decoders sequential,pipelined,blockwise \
            --speed-examples 50 --repeats 1 --threads ${THREADS:-2} eval.batch_size=16 \
            trainer.enable_progress_bar=false data=jsonl data.path="$DATA/cnndm" \
            data.max_source_length=320 data.max_target_length=200 data.max_subsequences=8 \
            data.max_subsequence_length=64 data.max_eval_examples=200 \
            trainer.max_epochs=40 trainer.max_time=00:00:35:00 --out results/cnndm.json ;;
    peers)  # the headline tables' examples and batch size, one thread
        python -m tasks.bench.peers --ckpt "$3" --blockwise "$4" --pipelined "$5" --compiled --ctranslate2 --batch-size 16 \
            --examples 100 --repeats 9 --threads 1 --out "results/peers_$2.json" ;;
    pretrain)  # 2000 texts per folder at most, cut to 127 tokens, 8 epochs
        python -m tasks.experiments.pretrain \
            --data "$DATA/cnndm","$DATA/kp20k","$DATA/pubmed","$DATA/multispanqa" \
            data.max_train_examples=2000 data.max_eval_examples=100 data.max_target_length=128 \
            trainer.max_epochs=8 trainer.enable_progress_bar=false --out mlruns/pretrained/t5-tiny-denoiser.ckpt ;;
    kp20k-pretrained)  # C: a tasks.experiments.pretrain checkpoint; compare with the kp20k entry (random init)
        python -m tasks.compare --task keyphrase --decoders sequential,pipelined $SPEED \
            data=jsonl data.path="$DATA/kp20k" data.max_eval_examples=200 train.init_from="$2" \
            --out results/kp20k_pretrained.json ;;
    delay2)
        python -m tasks.compare --task keyphrase --decoders sequential,pipelined --sweep decoder.delay=2 \
            --ckpt "sequential=$2" $SPEED --out results/builtin_keyphrase_delay2.json ;;
    blockwise-frozen)  # Stern et al.'s frozen setting: only the proposal heads learn
        python -m tasks.compare --task keyphrase --decoders sequential,blockwise --ckpt "sequential=$2" \
            "train.init_from=$2" decoder.freeze_backbone=true $SPEED \
            --out results/builtin_keyphrase_blockwise_frozen.json ;;
    nar-distilled)  # NAR trained on the sequential model's outputs (tasks.experiments.distill); S is that model
        # one folder per teacher (tasks.experiments.distill never overwrites one): a rerun reuses it
        DISTILLED=".cache/distilled/builtin_keyphrase_$(sha1sum "$2" | cut -c1-12)"
        [ -d "$DISTILLED" ] || python -m tasks.experiments.distill --ckpt "$2" --out "$DISTILLED"
        # sequential is trained on the distilled data too (a --ckpt of S would be refused: other data)
        python -m tasks.compare --task keyphrase --decoders sequential,nar $SWEEP $SPEED \
            data=jsonl data.path="$DISTILLED" --out results/builtin_keyphrase_nar_distilled.json ;;
    aggressive-drafter)  # TASK, S: its sequential checkpoint; prints the drafter's checkpoint
        DISTILLED=".cache/distilled/builtin_$2_10000_$(sha1sum "$3" | cut -c1-12)"
        [ -d "$DISTILLED" ] || python -m tasks.experiments.distill --ckpt "$3" --out "$DISTILLED" \
            data.train_size=10000
        python -m tasks.fit --task "$2" --decoder nar data=jsonl data.path="$DISTILLED" \
            train.init_from="$3" decoder.iterations=1 decoder.freeze_encoder=true \
            trainer.enable_progress_bar=false ;;
    aggressive-distilled)  # TASK, S: its sequential checkpoint; N: its drafter (aggressive-drafter TASK S)
        python -m tasks.bench.gpu_benchmark --ckpt "sequential=$3" --ckpt "aggressive=$3" \
            --ckpt "aggressive(redraft=outgrown)=$3" --ckpt "aggressive(redraft=never)=$3" \
            --ckpt "aggressive(redraft=realign)=$3" --ckpt "aggressive(redraft=realign,draft_tokens=4)=$3" \
            --drafter "$4" --batch-sizes 1,16 --precision fp32 --repeats 9 --examples 100 --threads 1 \
            --out "results/builtin_$2_aggressive_shared_encoder.json" ;;
    onestep)
        python -m tasks.compare --task "$2" --decoders sequential,nar,onestep --ckpt "sequential=$3" \
            --sweep decoder.iterations=1 $SPEED --out "results/builtin_$2_onestep.json" ;;
    prototokens)
        EXPERIMENT="--ckpt $3 --texts 8 --restarts 2 --iterations 1000 --lengths 1,2,4,8,16,32 --context with,without"
        python -m tasks.experiments.prototokens $EXPERIMENT --arrangement e-m,e-e,e-m-alternating,m-e \
            --out "results/prototokens_$2.json"
        python -m tasks.experiments.prototokens $EXPERIMENT --arrangement e-m --share m \
            --out "results/prototokens_$2_share_m.json" ;;
    stop-rule)  # decode-time option: both rules on the same trained pipelined model
        python -m tasks.compare --task "$2" --decoders sequential,pipelined --ckpt "sequential=$3" \
            --ckpt "pipelined=$4" --sweep decoder.stop_rule=first_empty,all_end $SPEED \
            --out "results/builtin_$2_stop_rule.json" ;;
    delay-sweep)  # TASK [S]: one pipelined model per delay; S = a sequential checkpoint of TASK to reuse
        python -m tasks.compare --task "$2" --decoders sequential,pipelined --sweep decoder.delay=1,2,3,4 \
            ${3:+--ckpt "sequential=$3"} $SPEED --out "results/builtin_$2_delays.json" ;;
    drafts)  # NAME TASK S P B N [key=value ...]
        name="$2" task="$3" S="$4" P="$5" B="$6" N="$7"
        shift 7
        python -m tasks.compare --task "$task" --decoders sequential,pipelined,blockwise,nar,lookup,aggressive \
            --ckpt "sequential=$S" --ckpt "pipelined=$P" --ckpt "blockwise=$B" --ckpt "nar=$N" $SPEED "$@" \
            --out "results/${name}_drafts.json" ;;
    multispanqa-fit)  # the data=jsonl defaults, as kp20k; timing on 20 examples only (the drafts entry times)
        python -m tasks.compare --task qa --decoders sequential,pipelined,blockwise,nar --speed-examples 20 \
            --repeats 1 --threads ${THREADS:-2} eval.batch_size=16 trainer.enable_progress_bar=false \
            data=jsonl data.path="$DATA/multispanqa" --out multispanqa_fit.json ;;
    *)
        echo "usage: $0 keyphrase | summarization | qa | family TASK TYPE | kp20k | cnndm-calls | cnndm-baselines | cnndm | pretrain | kp20k-pretrained C | delay-sweep TASK [S] | delay2 S | blockwise-frozen S | nar-distilled S | onestep TASK S | prototokens TASK S | stop-rule TASK S P | drafts NAME TASK S P B N [key=value ...] | multispanqa-fit" >&2
        exit 2 ;;
esac
