"""The embedded engine: the Megatron model itself serving the rollout protocol in-process
(``engine``: admission, continuous batching, sampling; ``batched_forward``: the batched
prefill/decode forward and its compiled steps; ``step``: a step's index tensors; ``kv_cache``,
``memory_occupation``, ``sampling``, ``results``). See docs/engines.md."""
