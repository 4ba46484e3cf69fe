"""`specserve keys`: API keys in a server's state store."""

from __future__ import annotations

import json
import sys

from speculative.sampling import InvalidArgument

from .args import Parser


def add_parser(sub) -> None:
    k = sub.add_parser("keys", help="API keys of a server's state store (SPECSERVE_REDIS_URL, else the running "
                                    "local cluster's embedded store)")
    ks = k.add_subparsers(dest="keys_command", required=True, parser_class=Parser)
    kc = ks.add_parser("create", help="make a key; it is printed once and kept only as a hash")
    kc.add_argument("--name", default="", help="who the key is for")
    kc.add_argument("--rpm", type=int, default=None, help="most requests per minute (default: no limit)")
    kc.add_argument("--tpm", type=int, default=None, help="most prompt and output tokens per minute")
    kc.add_argument("--concurrency", type=int, default=None, help="most requests in flight at once")
    ks.add_parser("list", help="every key's id, name and limits (never the key)")
    kr = ks.add_parser("revoke", help="refuse a key from now on")
    kr.add_argument("id", help="the key's id (`keys list`)")


def _key_store():
    """The state store a server uses: Redis at SPECSERVE_REDIS_URL, else the embedded store of the
    local Ray cluster `specserve serve` runs."""
    import os

    from cluster.state import REDIS_URL_ENV

    url = os.environ.get(REDIS_URL_ENV)
    if url:
        from cluster.state import open_state_store

        return open_state_store(url)
    import ray

    from cluster.actors import NAMESPACE, STATE_ACTOR, _ActorStore

    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        return _ActorStore(ray.get_actor(STATE_ACTOR, namespace=NAMESPACE))
    except (ConnectionError, ValueError) as e:
        raise ValueError("no SPECSERVE_REDIS_URL and no running specserve cluster to keep keys in "
                         f"({type(e).__name__})") from None


def run(args) -> int:
    from router.auth import create_key

    store = _key_store()
    if args.keys_command == "create":
        for field in ("rpm", "tpm", "concurrency"):
            if getattr(args, field) is not None and getattr(args, field) < 1:
                raise InvalidArgument(field, f"must be at least 1, got {getattr(args, field)}")
        key, record = create_key(store, args.name, args.rpm, args.tpm, args.concurrency)
        print(json.dumps({"key": key, **record}))
        print("specserve: the key is shown only now; keep it", file=sys.stderr)
    elif args.keys_command == "list":
        for record in store.list_api_keys():
            print(json.dumps(record))
    elif not store.revoke_api_key(args.id):
        raise ValueError(f"no key has the id {args.id!r}")
    return 0

