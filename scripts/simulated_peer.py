"""The GPU check's second peer: a plain DecentralizedSGD on the CPU that holds tensors of the trainer's shapes and
only averages, so that rounds run back to back (the most averaging a swarm can ask of the trainer).

    python -m scripts.simulated_peer --schema S --initial_peers ADDR ...

``S`` is what the measured trainer wrote at its start: the averager's prefix (with its schema fingerprint, so the
two peers meet) and the shapes of the tensors it averages. hivemind and torch only, no VISSL.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import hivemind
import torch

from benchmarks.common import decentralized_sgd
from vissl_swarm.local_swarm import LOOPBACK


def run(args: argparse.Namespace) -> int:
    """Join, take the trainer's values once, then signal a step boundary every few ms until SIGINT/SIGTERM."""
    schema = json.loads(Path(args.schema).read_text())
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=[LOOPBACK], start=True)
    tensors = [torch.nn.Parameter(torch.zeros(shape)) for shape in schema["shapes"]]
    base_prefix = schema["prefix"].rsplit("_", 1)[0]
    averaging = decentralized_sgd(
        torch.optim.SGD(tensors, lr=0.0),
        dht,
        prefix=base_prefix,
        target_group_size=2,
        min_matchmaking_time=2.0,
        allreduce_timeout=60.0,
        next_chunk_timeout=10.0,
        compression="fp16",
    )
    assert averaging.prefix == schema["prefix"], (averaging.prefix, schema["prefix"])
    loaded = averaging.averager.load_state_from_peers(timeout=60)
    if loaded is not None:  # the trainer's parameters and float buffers, in the order it averages them
        metadata, served = loaded
        count = metadata["num_params"] + metadata["num_buffers"]
        values = [t for i, t in enumerate(served[:count]) if i < metadata["num_params"] or t.is_floating_point()]
        with torch.no_grad():
            for tensor, value in zip(tensors, values, strict=False):
                tensor.copy_(value)
    print(f"simulated peer {dht.peer_id} ready ({'with' if loaded else 'without'} the trainer's values)", flush=True)
    stop = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.append(True))
    while not stop:
        averaging.on_step_end()
        time.sleep(0.005)
    averaging.shutdown()
    dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schema", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
