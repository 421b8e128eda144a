"""`hicache route`: the command line of the router (engine_integration.serve.router).

Torch-free, like the router itself; the router's module is imported only to run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from hicache.routing import POLICIES, RoutingConfig, TierWeights

_D, _W = RoutingConfig(), TierWeights()


# The one line `hicache --help` shows for this subcommand.
HELP = "route requests across engine replicas by where their prefixes are cached"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a `hicache engine serve` replica, http://HOST:PORT (repeat for each)",
    )
    a(
        "--policy",
        choices=POLICIES,
        default=_D.policy,
        help="round_robin: in turn; least_load: fewest requests in flight; prefix: the most "
        "valuable cached prefix (tier-weighted) among replicas within --balance of the least "
        "loaded (default: %(default)s)",
    )
    a(
        "--balance",
        type=float,
        default=_D.balance,
        help="prefix: how many more requests in flight than the least loaded replica a "
        "replica may have and still win on its cache (default: %(default)s)",
    )
    a(
        "--min-share",
        type=float,
        default=_D.min_share,
        help="prefix: a cached prefix decides only when worth more than this share of the "
        "prompt's pages; below it the least loaded replica wins (default: %(default)s)",
    )
    a(
        "--weights",
        default=f"{_W.l1},{_W.l2},{_W.l3}",
        metavar="L1,L2,L3",
        help="what a cached page is worth in L1, L2, L3 (default: %(default)s)",
    )
    a("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    a("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (default: %(default)s)")
    a(
        "--l3-events",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="the cache daemon's KV events (hicache serve --events-endpoint): pages in the "
        "shared L3 count for every replica (default: none)",
    )
    a(
        "--l3-events-replay",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="the daemon's replay socket (--events-replay-endpoint)",
    )
    a(
        "--l3-events-token-file",
        default=None,
        metavar="PATH",
        help="a token of the daemon's --tenants-file (or --auth-token-file): a daemon with "
        "tokens publishes a namespace's events only to subscribers holding a token for it",
    )
    a(
        "--wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait at start for every replica to answer (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    from engine_integration.serve.openai_api import listen_for
    from engine_integration.serve.router import RouterConfig, serve

    try:
        l1, l2, l3 = (float(part) for part in args.weights.split(","))
        config = RouterConfig(
            replica_urls=tuple(args.replica),
            routing=RoutingConfig(
                args.policy, args.balance, args.min_share, TierWeights(l1, l2, l3)
            ),
            host=args.host,
            port=args.port,
            l3_events=args.l3_events,
            l3_replay=args.l3_events_replay,
            l3_token_file=args.l3_events_token_file,
            wait_s=args.wait,
        )
    except ValueError as error:
        print(f"hicache route: error: {error}", file=sys.stderr)
        return 2
    sock = listen_for("hicache route", config.host, config.port)  # before replicas are awaited
    if sock is None:
        return 2
    with sock:
        return asyncio.run(serve(config, sock))
