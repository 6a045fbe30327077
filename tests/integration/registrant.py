"""Registers one Instance in etcd and keeps it alive until killed (a subprocess of test_discovery_etcd.py).

    python registrant.py --etcd 127.0.0.1:2379 --ttl 3 --id w1 --address 127.0.0.1:9000

Prints `registered <id>` on stdout once the record is in etcd; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.v1 import discovery_pb2


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--etcd", required=True, help="etcd host:port")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL in seconds")
    parser.add_argument("--namespace", default="meshllm")
    parser.add_argument("--component", default="worker")
    parser.add_argument("--endpoint", default="generate")
    parser.add_argument("--id", required=True, help="instance id")
    parser.add_argument("--address", required=True, help="address to publish")
    args = parser.parse_args(argv)
    async with await EtcdDiscovery.connect([args.etcd], args.namespace, lease_ttl_s=args.ttl) as discovery:
        await discovery.register_instance(
            discovery_pb2.Instance(id=args.id, component=args.component, endpoint=args.endpoint, address=args.address, dp_size=1)
        )
        print(f"registered {args.id}", flush=True)
        await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main(sys.argv[1:]))
