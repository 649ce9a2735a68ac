"""Weights from the trainer to the engines: ``transports`` (one class per
``rollout.sglang.weight_update`` kind, a registry), ``sync`` (bucketing, pushes),
``tensor_payload`` (the ``update_weights_from_tensor`` payload formats), ``group`` (the
distributed weight-update group), and ``relay/``: the relay service (Laminar's relay tier), whose
publisher is the ``relay`` transport. See docs/engines.md and docs/relay.md."""
