"""The relay weight service (Laminar, arXiv 2510.12633): the trainer publishes each weight
version once to a root relay; relays pull from each other (a chain or a tree) and load the
newest version into their own engines, each engine on its own schedule.

- ``versions``: what a relay holds (immutable versions, complete or absent, collection);
- ``codec``: a bucket of named tensors as checksummed safetensors bytes;
- ``readback``: what is read back from an engine after a load and when it matches;
- ``server``: ``megatron-earl relay`` (receive, fan out, ``/relay_info``);
- ``applier``: feeding one engine (load, read back, the release rule);
- ``wire``: the API-key variable and checksum header clients and server share;
- ``publisher``: the trainer's side and the ``relay`` weight transport;
- ``settings``: a relay's settings and counters (the server and its appliers read them);
- ``launch``: starting relay processes (tests, benchmarks, scripts).
"""
