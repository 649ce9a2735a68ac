"""Weights from the trainer to the engines: ``transports`` (one class per
``rollout.sglang.weight_update`` kind, a registry), ``sync`` (bucketing, pushes),
``tensor_payload`` (the ``update_weights_from_tensor`` payload formats), ``group`` (the
distributed weight-update group). The relay service (``megatron_earl.relay``) publishes through
them. See docs/engines.md and docs/relay.md."""
