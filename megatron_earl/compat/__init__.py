"""Compatibility with the installed megatron-core and hardware.

Every runtime patch of megatron-core lives in this package; each module opens with a header saying
why it exists and for which versions. ``optional`` detects optional packages (TE, apex, SGLang).
"""
