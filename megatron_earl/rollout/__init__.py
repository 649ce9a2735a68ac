"""Rollout: ``engine`` (the engine protocol every engine kind serves and the agent loop calls),
``embedded/`` (the embedded engine), ``serve/`` (``megatron-earl serve``), ``sglang/`` (the
SGLang client, launcher, router and pool), ``weights/`` (weight transports, and the relay
service under ``weights/relay/``), ``agent/`` (multi-turn agent rollouts), ``repack``
(trajectories moved between engines). See docs/engines.md and docs/agents.md."""
