"""The client side of SGLang engines (real SGLang or ``megatron-earl serve``): ``client`` (the
HTTP protocol, retries), ``launcher`` (starting server processes), ``router`` (SGLang's router in
front of them), ``pool`` (several engines, health checks and fail-over). See docs/engines.md."""
