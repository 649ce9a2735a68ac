"""What each Megatron-LM flag means here: mapped, refused (with why), or no effect.

Every flag of Megatron-LM's parser (``megatron/training/arguments.py``, core_v0.16.1; the list is
``tests/fixtures/megatron_lm_flags_core_v0.16.1.json``, made by
``scripts/extract_megatron_flags.py``) is in exactly one category:

* **mapped**: declared by ``megatron_flags.add_megatron_flags`` and turned into ``RunConfig``
  fields by ``megatron_args.config_from_megatron_args``;
* **mapped (RoPE scaling)**: ``ROPE_SCALING_FLAGS``, mapped by the RoPE-scaling work of issue 18;
  until ``add_megatron_flags`` declares one of them, it is refused like the flags below;
* **refused**: ``REFUSED_FLAGS`` (flag -> why, and what to use instead): the flag would change the
  model or the run in a way this plugin does not honour, so giving it (with a value other than
  Megatron-LM's default) is an error naming it;
* **no effect**: ``NO_EFFECT_FLAGS``: the flag cannot change the run here (logging, profiling,
  pretraining data paths and tokenizers, kernel fusions and communication overlap that do not
  change the numerics, Megatron's inference engine); accepted, and listed in one line at start-up.

``docs/megatron_args.md``'s flag table is generated from these tables
(``scripts/megatron_flags_table.py``; a test checks the file is current).
"""

from __future__ import annotations


def _flags(spec: str) -> dict[str, int | str]:
    """``"--a --b= --c=+"`` -> {flag: number of values}: 0 a switch, 1 one value, "+" one or
    more, an int that many."""
    out: dict[str, int | str] = {}
    for item in spec.split():
        flag, _, nargs = item.partition("=")
        out[flag] = (
            0 if "=" not in item else (1 if not nargs else int(nargs) if nargs.isdigit() else nargs)
        )
    return out


ROPE_SCALING_FLAGS: tuple[str, ...] = (
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "--rope-type",
    "--rotary-percent",
    "--rotary-seq-len-interpolation-factor",
    "--rotary-scaling-factor",
    "--mscale",
    "--mscale-all-dim",
)
"""RoPE scaling and rotary variants: mapped by the RoPE-scaling work (issue 18 item 1)."""

ROPE_PENDING = (
    "RoPE scaling and rotary variants are mapped by the RoPE-scaling work (issue 18 item 1), "
    "which this build does not have: the flag would be dropped and the model would differ"
)

NO_EFFECT_FLAGS: dict[str, int | str] = _flags(
    # logging, profiling, monitoring
    """
    --log-interval= --log-params-norm --log-throughput --log-progress --timing-log-level=
    --timing-log-option= --tensorboard-log-interval= --tensorboard-queue-size=
    --log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard
    --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-memory-interval=
    --log-device-memory-used --log-num-zeros-in-grad --log-max-attention-logit
    --no-barrier-with-level-1-timing --log-world-size-to-tensorboard --wandb-project=
    --wandb-exp-name= --wandb-save-dir= --wandb-entity= --logging-level= --log-energy
    --profile --profile-step-start= --profile-step-end= --use-pytorch-profiler --profile-ranks=+
    --record-memory-history --memory-snapshot-path= --log-straggler --straggler-ctrlr-port=
    --straggler-minmax-count= --disable-straggler-on-startup --run-workload-inspector-server
    --no-one-logger --one-logger-project= --one-logger-run-name= --one-logger-async
    --app-tag-run-name= --app-tag-run-version= --config-logger-dir= --disable-msc
    --result-rejected-tracker-filename= --dump-param-to-param-group-map=
    --check-weight-hash-across-dp-replicas-interval= --save-wgrads-interval=
    --save-dgrads-interval=
    """
    # pretraining data, dataloader and tokenizer (rollouts come from the environment; the
    # tokenizer is the run's `tokenizer`), pretraining batch sizes (the RL batch is
    # batch.prompts_per_step x batch.samples_per_prompt, packed by tokens) and validation
    """
    --data-path=+ --phase-transition-iterations= --split= --train-data-path=+
    --valid-data-path=+ --test-data-path=+ --data-args-path= --per-split-data-args-path=
    --per-dataset-sequences-path= --dataloader-fast-cache-load --dataloader-defer-npy-index-mmap
    --data-cache-path= --no-mmap-bin-files --mock-data --sample-rate= --mask-prob=
    --short-seq-prob= --num-workers= --reset-position-ids --reset-attention-mask --eod-mask-loss
    --no-create-attention-mask-in-dataloader --num-dataset-builder-threads=
    --object-storage-cache-path= --mid-level-dataset-surplus= --allow-ambiguous-pad-tokens
    --fim-data --fim-rate= --fim-spm-rate= --fim-split-sample= --fim-fragment-rate=
    --fim-no-prefix= --fim-prefix-token= --fim-middle-token= --fim-suffix-token= --fim-pad-token=
    --fim-eod-token= --dataloader-type= --exit-signal-handler-for-dataloader --vocab-file=
    --merge-file= --tokenizer-type= --tokenizer-model= --tokenizer-metadata=
    --tokenizer-special-tokens=+ --legacy-tokenizer --tiktoken-pattern=
    --tiktoken-num-special-tokens= --tiktoken-special-tokens=+ --tokenizer-sentencepiece-legacy
    --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens --trust-remote-code
    --no-use-tokenizer-model-from-checkpoint-args --micro-batch-size= --global-batch-size=
    --batch-size= --eval-iters= --eval-interval= --full-validation --multiple-validation-sets
    """
    # kernels, fusions, overlap and communication tuning that keep the numerics
    """
    --use-flash-attn --use-mcore-models --attention-backend=
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
    --no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion
    --no-persist-layer-norm --disable-jit-fuser --cross-entropy-loss-fusion
    --cross-entropy-fusion-impl= --calculate-per-token-loss --attention-softmax-in-fp32
    --accumulate-allreduce-grads-in-fp32 --no-check-for-nan-in-loss-and-grad
    --no-position-embedding --onnx-safe= --no-clone-scatter-output-in-embedding
    --tp-comm-overlap --no-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag
    --no-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag --no-tp-comm-split-rs
    --tp-comm-bootstrap-backend= --tp-comm-overlap-cfg= --no-async-tensor-model-parallel-allreduce
    --delay-wgrad-compute --use-ring-exchange-p2p --defer-embedding-wgrad-compute
    --wgrad-deferral-limit= --overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication
    --pipeline-model-parallel-comm-backend= --no-scatter-gather-tensors-in-pipeline
    --overlap-grad-reduce --no-align-grad-reduce --ddp-num-buckets= --ddp-bucket-size=
    --ddp-pad-buckets-for-high-nccl-busbw --overlap-param-gather
    --overlap-param-gather-with-optimizer-step --no-align-param-gather --use-nccl-ub
    --disable-symmetric-registration --fsdp-manual-registration --use-sharp --sharp-enabled-group=
    --create-all-gather-group --nccl-communicator-config-path= --distributed-backend=
    --distributed-timeout-seconds-after-init= --local-rank=
    --high-priority-stream-groups=+ --empty-unused-memory-level= --train-sync-interval=
    --manual-gc --manual-gc-interval= --no-manual-gc-eval --no-pin-cpu-grads --no-pin-cpu-params
    --override-opt_param-scheduler
    """
    # Megatron-LM checkpoint formats and I/O (earl writes its own checkpoints, always with the
    # optimizer and RNG state); --load (checkpoint.load) loads weights only and starts at step 0,
    # which is what --finetune --no-load-optim --no-load-rng ask for
    """
    --finetune --no-load-optim --no-load-rng --no-save-optim --no-save-rng
    --ckpt-format= --auto-detect-ckpt-format --no-ckpt-fully-parallel-save --async-save
    --use-persistent-ckpt-worker --ckpt-fully-parallel-load --ckpt-assume-constant-structure
    --no-strict-fsdp-dtensor-load --dist-ckpt-strictness= --dist-ckpt-save-pre-mcore-014
    --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
    --use-dist-ckpt --dist-ckpt-format= --ckpt-fully-parallel-save
    """
    # Megatron's own inference engine (rollouts run in SGLang or the embedded engine), and the
    # settings of fault-tolerance packages whose switch is refused
    """
    --inference-batch-times-seqlen-threshold= --max-tokens-to-oom= --output-bert-embeddings
    --bert-embedder-type= --cuda-graph-scope=+ --use-legacy-static-engine
    --inference-max-requests= --inference-max-seq-length= --inference-max-batch-size=
    --inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb=
    --inference-dynamic-batching-paused-buffer-size-gb= --inference-dynamic-batching-block-size=
    --inference-dynamic-batching-max-requests= --inference-dynamic-batching-max-tokens=
    --inference-dynamic-batching-num-cuda-graphs=
    --inference-dynamic-batching-track-paused-request-events --decode-only-cuda-graphs
    --inference-dynamic-batching-unified-memory-level= --nccl-all-reduce-for-prefill
    --enable-chunked-prefill --disable-chunked-prefill
    --inference-dynamic-batching-cuda-graph-max-tokens=
    --inference-dynamic-batching-cuda-graph-mixed-prefill-count=
    --inference-logging-step-interval= --inference-wandb-logging --inference-coordinator-port=
    --flash-decode --symmetric-ar-type= --inference-fuse-tp-communication
    --inprocess-max-iterations= --inprocess-monitor-thread-interval=
    --inprocess-monitor-process-interval= --inprocess-progress-watchdog-interval=
    --inprocess-heartbeat-interval= --inprocess-soft-timeout= --inprocess-hard-timeout=
    --inprocess-heartbeat-timeout= --inprocess-barrier-timeout= --inprocess-completion-timeout=
    --inprocess-last-call-wait= --inprocess-termination-grace-time= --inprocess-granularity=
    --inprocess-active-world-size= --inprocess-empty-cuda-cache --calc-ft-timeouts
    --ft-num-warmup-iters= --adlr-autoresume-interval=
    """
)
"""Accepted, no effect here (flag -> number of values); listed at start-up when given."""

_REFUSED_BY_REASON: dict[str, str] = {
    "this mixture-of-experts option is not supported here (the mapped MoE flags: --num-experts, "
    "--moe-router-topk, --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, "
    "--moe-router-score-function, --moe-router-load-balancing-type, --moe-aux-loss-coeff, "
    "--moe-z-loss-coeff, --moe-expert-capacity-factor, --moe-token-drop-policy, "
    "--moe-router-enable-expert-bias, --moe-router-bias-update-rate, --moe-grouped-gemm, "
    "--moe-token-dispatcher-type allgather|alltoall, --expert-model-parallel-size, "
    "--expert-tensor-parallel-size; megatron_earl/docs/moe.md)": """
    --moe-extended-tp --overlap-moe-expert-parallel-comm --ep-overlap-early-attn-memory-release
    --moe-shared-expert-gate --moe-shared-expert-overlap --moe-enable-routing-replay
    --moe-router-padding-for-quantization --moe-router-padding-for-fp8 --moe-router-num-groups=
    --moe-router-group-topk= --moe-router-pre-softmax --moe-router-topk-scaling-factor=
    --moe-router-dtype= --moe-router-force-load-balancing --moe-use-legacy-grouped-gemm
    --moe-input-jitter-eps= --moe-enable-deepep --moe-flex-dispatcher-backend=
    --moe-per-layer-logging --moe-pad-expert-input-to-capacity --moe-layer-recompute
    --moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input --moe-latent-size=
    --moe-deepep-num-sms= --moe-hybridep-num-sms= --moe-layer-freq= --moe-use-upcycling
    --moe-upcycling-granularity= --moe-pad-experts-for-cuda-graph-inference
    """,
    "only SwiGLU decoder models (Llama/Qwen family, dense or mixture-of-experts) are built here; "
    "MLA, multi-token prediction, Mamba/hybrid, linear or sparse attention variants, "
    "encoder-decoder, BERT/ICT/vision models are not": """
    --mtp-standalone
    --mtp-num-layers= --mtp-loss-scaling-factor= --multi-latent-attention
    --experimental-attention-variant= --dsa-indexer-n-heads= --dsa-indexer-head-dim=
    --dsa-indexer-topk= --dsa-indexer-loss-coeff= --dsa-indexer-use-sparse-loss
    --linear-conv-kernel-dim= --linear-key-head-dim= --linear-value-head-dim=
    --linear-num-key-heads= --linear-num-value-heads= --linear-attention-freq=
    --q-lora-rank= --kv-lora-rank= --qk-head-dim= --qk-pos-emb-head-dim= --v-head-dim=
    --cache-mla-latents --is-hybrid-model --mamba-state-dim= --mamba-head-dim= --mamba-num-groups=
    --mamba-num-heads= --disable-mamba-mem-eff-path --mlp-chunks-for-prefill=
    --hybrid-attention-ratio= --hybrid-mlp-ratio= --hybrid-override-pattern= --mrope-section=+
    --encoder-num-layers= --decoder-num-layers= --encoder-seq-length= --decoder-seq-length=
    --relative-attention-num-buckets= --relative-attention-max-distance= --bert-no-binary-head
    --vocab-extra-ids= --ict-head-size= --biencoder-projection-dim=
    --biencoder-shared-query-context-model --ict-load= --bert-load= --titles-data-path=
    --query-in-block-prob= --use-one-sent-docs --evidence-data-path=
    --retriever-report-topk-accuracies=+ --retriever-score-scaling --block-data-path=
    --embedding-path= --indexer-batch-size= --indexer-log-interval= --num-classes= --img-h=
    --img-w= --num-channels= --patch-dim= --classes-fraction= --data-per-class-fraction=
    --no-data-sharding --head-lr-mult= --vision-pretraining --vision-pretraining-type=
    --vision-backbone-type= --swin-backbone-type= --mask-type= --mask-factor= --iter-per-epoch=
    --dino-local-img-size= --dino-local-crops-number= --dino-head-hidden-size=
    --dino-bottleneck-size= --dino-freeze-last-layer= --dino-norm-last-layer
    --dino-warmup-teacher-temp= --dino-teacher-temp= --dino-warmup-teacher-temp-epochs=
    --heterogeneous-layers-config-path= --heterogeneous-layers-config-encoded-json=
    --use-legacy-models --spec=+
    """,
    "the model is a Llama/Qwen-style transformer (pre-norm RMSNorm, SwiGLU, no bias but the "
    "optional QKV bias, full causal attention, half-split RoPE on every layer, Megatron-Core's "
    "default initialization); this architecture or initialization option is not built here": """
    --softmax-type= --fp32-residual-connection --apply-residual-connection-post-layernorm
    --apply-layernorm-1p --glu-linear-offset= --activation-func-clamp-value= --rotary-interleaved
    --qk-l2-norm --qk-clip --qk-clip-alpha= --qk-clip-threshold= --attention-output-gate
    --embedding-init-method-std= --init-model-with-meta-device --apply-query-key-layer-scaling
    --disable-bf16-reduced-precision-matmul --use-fused-weighted-squared-relu --window-size=
    --window-attn-skip-freq= --no-rope-freq= --openai-gelu --squared-relu --quick-geglu
    --init-method-xavier-uniform --data-parallel-random-init --te-rng-tracker
    --inference-rng-tracker --no-initialization --use-cpu-initialization --use-te-activation-func
    --padded-vocab-size= --deterministic-mode --batch-invariant-mode --fp16-lm-cross-entropy
    """,
    "FP8/FP4 and precision-aware optimizer states are not supported: weights train in "
    "--bf16/--fp16/fp32 with fp32 master weights, fp32 Adam states and fp32 gradient "
    "reduction": """
    --fp8-format= --fp8-recipe= --fp8-quantizer-factory= --fp8-margin= --fp8-interval=
    --fp8-amax-history-len= --fp8-amax-compute-algo= --no-fp8-wgrad --first-last-layers-bf16
    --num-layers-at-start-in-bf16= --num-layers-at-end-in-bf16= --use-kitchen-attention
    --kitchen-attention-backend= --fp4-format= --fp4-recipe= --fp4-param-gather
    --fp4-quantizer-factory= --fp8-param-gather --te-precision-config-file=
    --keep-fp8-transpose-cache
    --reuse-grad-buf-for-mxfp8-param-ag --use-precision-aware-optimizer --main-grads-dtype=
    --main-params-dtype= --exp-avg-dtype= --exp-avg-sq-dtype= --grad-reduce-in-bf16
    --ddp-reduce-scatter-with-fp32-accumulation --ddp-average-in-collective
    """,
    "the fp16 loss scaler runs with Megatron-Core's defaults (dynamic scaling); its settings are "
    "not configurable here (use --bf16, which needs no loss scaling)": """
    --loss-scale= --initial-loss-scale= --min-loss-scale= --loss-scale-window= --hysteresis=
    """,
    "parallelism and memory options beyond tp/cp/pp/vpp/dp with Megatron's (optionally "
    "distributed) optimizer are not supported: layers split evenly over pipeline stages, DP "
    "replicates the model (use --use-distributed-optimizer to shard optimizer state), set "
    "model.cp_comm_type in the earl config for the CP scheme": """
    --hierarchical-context-parallel-sizes=+ --max-seqlen-per-dp-cp-rank= --hybrid-context-parallel
    --cp-comm-type=+ --decoder-first-pipeline-num-layers= --decoder-last-pipeline-num-layers=
    --pipeline-model-parallel-layout= --account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split --microbatch-group-size-per-virtual-pipeline-stage=
    --model-parallel-size= --use-megatron-fsdp --data-parallel-sharding-strategy=
    --outer-dp-sharding-strategy= --no-gradient-reduce-div-fusion --fsdp-double-buffer
    --suggested-communication-unit-size= --enable-full-sharding-in-hsdp --use-torch-fsdp2
    --torch-fsdp2-no-reshard-after-forward --num-distributed-optimizer-instances=
    --use-tp-pp-dp-mapping --fake-process-group --lazy-mpu-init= --disable-gloo-process-groups
    --cpu-offloading-num-layers= --fine-grained-activation-offloading --offload-modules=+
    --min-offloaded-tensor-size= --optimizer-cpu-offload --optimizer-offload-fraction=
    --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d
    --distribute-saved-activations --recompute-modules=+ --enable-cuda-graph
    --cuda-graph-warmup-steps= --external-cuda-graph --cuda-graph-impl= --rl-training-cuda-graphs
    """,
    "deprecated activation-recompute switch: use --recompute-granularity selective (or full)": """
    --recompute-activations --checkpoint-activations
    """,
    "the optimizer is Adam (AdamW) or SGD with a constant weight decay; Muon, decoupled "
    "embedding learning rates and weight-decay schedules are not supported (use --optimizer "
    "adam|sgd and --weight-decay)": """
    --muon-momentum= --muon-no-split-qkv --muon-use-nesterov --muon-scale-mode=
    --muon-fp32-matmul-prec= --muon-num-ns-steps= --muon-tp-mode= --muon-extra-scale-factor=
    --no-weight-decay-cond-type= --apply-wd-to-qk-layernorm --decoupled-lr= --decoupled-min-lr=
    --start-weight-decay= --end-weight-decay= --weight-decay-incr-style=
    """,
    "the learning-rate schedule counts optimizer steps, not samples, and is computed from the "
    "run's config on every start: use --lr-warmup-iters/--lr-warmup-fraction, --lr-decay-iters, "
    "--lr-wsd-decay-iters": """
    --lr-decay-samples= --lr-wsd-decay-samples= --lr-warmup-samples= --warmup=
    --use-checkpoint-opt_param-scheduler
    """,
    "the run length is --train-iters RL steps (`steps`); sample budgets, batch ramp-up, early "
    "exits and skipped iterations are not supported": """
    --train-samples= --rampup-batch-size=3 --decrease-batch-size-if-needed --exit-interval=
    --exit-duration-in-mins= --exit-signal-handler --exit-signal= --iterations-to-skip=+
    --skip-train --test-mode --check-for-large-grads --error-injection-rate=
    --error-injection-type= --rerun-mode= --check-for-spiky-loss
    """,
    "earl checkpoints always hold the model, the optimizer and the RNG state, and resume with "
    "the run's own config: use checkpoint.load (an earl checkpoint or a converted model) and "
    "checkpoint.interval / keep_last / keep_every in the earl config": """
    --pretrained-checkpoint= --ckpt-step= --use-checkpoint-args
    --use-mp-args-from-checkpoint-args --exit-on-missing-checkpoint --load-main-params-from-ckpt
    --save-retain-interval=
    --non-persistent-save-interval= --non-persistent-ckpt-type=
    --non-persistent-global-ckpt-dir= --non-persistent-local-ckpt-dir=
    --non-persistent-local-ckpt-algo= --replication --replication-jump= --replication-factor=
    --ckpt-convert-format= --ckpt-convert-save= --ckpt-convert-update-legacy-dist-opt-format
    """,
    "fault-tolerance and auto-resume services are not provided: restart the run, it resumes "
    "from its latest checkpoint": """
    --inprocess-restart --enable-ft-package --adlr-autoresume
    """,
    "Megatron-LM's built-in RL and SFT loops are not this plugin's: set the RL run in the earl "
    "config (--earl-config, --earl-* flags: batch.prompts_per_step, batch.samples_per_prompt, "
    "train.loss, sampling, the sft section, layouts.rollout)": """
    --perform-rl-step --rl-prompts-per-eval= --grpo-prompts-per-step= --grpo-group-size=
    --grpo-iterations= --grpo-clamp-eps-lower= --grpo-clamp-eps-upper= --grpo-kl-beta=
    --grpo-entropy-term-weight= --grpo-filter-groups-with-same-reward
    --langrl-inference-server-type= --langrl-inference-server-conversation-template=
    --langrl-external-server --langrl-env-config= --rl-default-temperature= --rl-default-top-p=
    --rl-default-top-k= --rl-offload-optimizer-during-inference
    --rl-offload-kv-cache-during-training --rl-remove-kv-cache-during-training
    --rl-reset-cuda-graphs --rl-partial-rollouts --rl-inference-logprobs-is-correction
    --rl-importance-sampling-truncation-coef= --rl-use-sequence-packing
    --rl-sequence-packing-max-sequences-per-bin= --rl-sequence-packing-algo=
    --rl-inference-tensor-model-parallel-size= --rl-inference-pipeline-model-parallel-size=
    --rl-inference-expert-model-parallel-size= --rl-inference-expert-tensor-model-parallel-size=
    --rl-inference-model-unified-memory-level= --rl-offload-inference-model-weights-when-idle
    --refit-method= --rl-verify-model-weights-swap --rl-parallel-generation-tasks=
    --rl-skip-bos-token --sft --sft-tokenizer-prompt-format= --yaml-cfg= --enable-experimental
    """,
}

REFUSED_FLAGS: dict[str, str] = {
    flag: reason for reason, spec in _REFUSED_BY_REASON.items() for flag in _flags(spec)
}
"""Refused flags: flag -> why it is not honoured here and what to use instead."""
