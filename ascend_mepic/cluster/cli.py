"""``ascend-mepic route``: one address in front of several ``ascend-mepic serve`` replicas."""

from __future__ import annotations

import argparse
import atexit
import logging
import subprocess
import sys
import time

log = logging.getLogger("ascend_mepic.cluster")


def parse_replica(spec: str) -> tuple[str, str | None, str | None]:
    """``URL``, ``URL=EVENTS`` or ``URL=EVENTS,REPLAY``: the replica's ``--kv-events-config``
    endpoint and replay endpoint as the indexer reaches them, e.g.
    ``http://10.0.0.2:8000=tcp://10.0.0.2:5557,tcp://10.0.0.2:5558``."""
    url, sep, rest = spec.partition("=")
    events, _, replay = rest.partition(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--replica {spec!r}: the URL must start with http:// or https://")
    for name, value in (("event", events), ("replay", replay)):
        if value and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--replica {spec!r}: the {name} endpoint must be tcp:// or ipc://")
    if sep and not events:
        raise ValueError(f"--replica {spec!r}: no event endpoint after '='")
    return url.rstrip("/"), (events or None), (replay or None)


def start_indexer(port: int, block_size: int) -> tuple[str, subprocess.Popen]:
    """Start Dynamo's standalone indexer as a child process; returns (URL, process)."""
    import httpx

    from ascend_mepic.cluster.indexer import indexer_command

    proc = subprocess.Popen(indexer_command(port, block_size), stdout=sys.stderr)
    atexit.register(proc.terminate)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Dynamo's indexer exited with {proc.returncode}")
        try:
            if httpx.get(url + "/workers", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"Dynamo's indexer did not answer on {url} in 30 s")


def cmd_route(args: argparse.Namespace) -> int:
    import uvicorn

    from ascend_mepic.cluster.front import ClusterFront, build_app
    from ascend_mepic.cluster.indexer import DynamoIndexer
    from ascend_mepic.cluster.policy import Replica, make_policy
    from ascend_mepic.cluster.request_chunks import RequestReader
    from ascend_mepic.entrypoints.cli import _tokenizer

    specs = [parse_replica(s) for s in args.replica]
    replicas = [Replica(i, url, ev, replay) for i, (url, ev, replay) in enumerate(specs)]
    indexer_url = args.indexer
    if args.policy != "round_robin":
        missing = [r.url for r in replicas if r.events is None]
        if missing:
            raise ValueError(
                f"policy {args.policy!r} reads the replicas' KV events: give each --replica as "
                f"URL=EVENT_ENDPOINT (missing for {missing})"
            )
        if indexer_url is None and args.start_indexer is None:
            raise ValueError(f"policy {args.policy!r} needs --indexer URL or --start-indexer PORT")
        if indexer_url is None:
            indexer_url, _ = start_indexer(args.start_indexer, args.block_size)
    indexer = DynamoIndexer(indexer_url) if indexer_url else None
    policy = make_policy(
        args.policy, indexer, args.load_factor, args.affinity_s, args.queue_gap, args.load_window
    )
    reader = RequestReader(_tokenizer(args.tokenizer))
    front = ClusterFront(replicas, policy, reader, indexer, args.block_size, args.health_interval_s)
    logging.getLogger("ascend_mepic.cluster").setLevel(args.log_level.upper())
    uvicorn.run(build_app(front), host=args.host, port=args.port, log_level="warning")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ascend_mepic.cluster.policy import AFFINITY_S, LOAD_FACTOR, LOAD_WINDOW, QUEUE_GAP

    p = sub.add_parser(
        "route",
        help="route requests over several `ascend-mepic serve` replicas by the chunks they hold",
        description="An HTTP front for /v1/completions and /v1/chat/completions over MEPIC "
        "replicas. Policy chunk (default) asks Dynamo's KV indexer which replica holds each "
        "of a request's chunks (MEPIC publishes resident chunks as KV events); prefix scores "
        "the prompt from token 0, as prefix routers do; round_robin ignores residency. "
        "docs/cluster.md has the deployment.",
    )
    p.add_argument(
        "--replica", action="append", required=True, metavar="URL[=EVENTS[,REPLAY]]",
        help="a replica's HTTP URL, and its KV event and replay endpoints as the indexer "
        "reaches them (the replica's --kv-events-config endpoint and replay_endpoint, "
        "tcp://HOST:PORT), repeat per replica",
    )  # fmt: skip
    p.add_argument("--policy", choices=["chunk", "prefix", "round_robin"], default="chunk")
    p.add_argument("--indexer", help="URL of a running Dynamo indexer (python -m dynamo.indexer)")
    p.add_argument(
        "--start-indexer", type=int, metavar="PORT",
        help="start Dynamo's indexer here on PORT (it binds 0.0.0.0: keep PORT private)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=32, help="the replicas' --block-size")
    p.add_argument("--tokenizer", help="the replicas' model or tokenizer folder (reads chunks)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--load-factor", type=float, default=LOAD_FACTOR, help="bounded-load factor, >= 1"
    )
    p.add_argument(
        "--load-window", type=int, default=LOAD_WINDOW,
        help="how many recent decisions the load factor's share is counted over",
    )  # fmt: skip
    p.add_argument(
        "--queue-gap", type=int, default=QUEUE_GAP,
        help="most requests in flight a replica may have beyond the least busy one's, >= 0",
    )  # fmt: skip
    p.add_argument(
        "--affinity-s", type=float, default=AFFINITY_S,
        help="seconds a chunk counts as held by the replica it was last sent to",
    )  # fmt: skip
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"],
        help="the front's log level (debug: every routing decision with its scores)",
    )  # fmt: skip
    p.set_defaults(func=cmd_route)
