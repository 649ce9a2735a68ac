"""What the installed environment offers: ``version`` guards the megatron-core release (the one
every patch is written for); ``optional`` detects optional packages (TE, SGLang);
``event_loop.run`` is ``asyncio.run`` without a CPython 3.11 cost (module docstring);
``http_guard`` is what every HTTP server of the project checks before a handler runs (keys,
body size, JSON), against aiohttp's behaviour; ``user_threads`` runs user code written as plain
functions (environments, tools, reward functions) on a bounded pool of worker threads, for the
agent loop and the reward service alike. The
patches themselves live in the top-level ``patches/`` (installed as ``megatron_earl.patches``).
"""
