"""``megatron-earl serve``: an HTTP server with SGLang's native API over the embedded engine
(``server``: routes and limits; ``auth``: keys and body limits; ``generate_api``: ``/generate``
parsing and answers; ``model``: what is served; ``weights``: the weight-update endpoints;
``memory``: memory release for colocation; ``tp`` and ``follower``: ``--tp-size`` ranks). See
docs/engines.md."""
