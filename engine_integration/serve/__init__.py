"""Serving over the embedded engine: HTTP replicas, the router, and `hicache demo`.

    replica.py      `hicache engine serve`: an OpenAI-compatible server over one Engine
    replica_config.py  ReplicaConfig: one replica's settings, checked before anything loads
    engine_cli.py   the `hicache engine` command line (torch-free)
    openai_api.py   the OpenAI request and response shapes, validated at the edge
    router.py       `hicache route`: sends each request where its prefix is cached
    route_index.py  what the router knows of each replica's cache, from its KV events
    route_replicas.py  the router's replicas: connected, probed, marked dead
    route_cli.py    the `hicache route` command line
    workload.py     the demo's multi-turn chat: real questions, token-exact histories
    demo.py         the `hicache demo` command line (torch-free)
    demo_config.py  DemoConfig and the demo's defaults
    demo_runner.py  the demo's run: cache on, cache off, the comparison table

It imports the engine (`engine_integration.engine`), never the adapters.
"""
