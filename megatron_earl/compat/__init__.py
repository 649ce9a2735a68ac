"""What the installed environment offers: ``version`` guards the megatron-core release (the one
every patch is written for); ``optional`` detects optional packages (TE, SGLang). The
patches themselves live in the top-level ``patches/`` (installed as ``megatron_earl.patches``).
"""
