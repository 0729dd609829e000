"""The floor under ClusterEnv's step time: bare pyzmq lockstep with no env and no framing.

One ROUTER (the learner) sends a 200-byte message to each of ``--workers`` DEALER
processes, each busy-waits ``--work-us`` microseconds (standing in for stepping its
envs) and replies; the learner waits for every reply. This is ClusterEnv's message
pattern without any of its Python work, so its step time is what ZeroMQ's thread
hand-offs (application thread -> I/O thread -> socket -> I/O thread -> application
thread, each way) cost on this machine.

    python benchmarks/probes/zmq_floor.py --workers 2 --work-us 68   # CartPole, 16 envs on 2 workers
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import zmq


def burn(microseconds: float) -> None:
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def worker(address: str, identity: bytes, work_us: float) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send(b"hello")
    while (message := socket.recv()) != b"stop":
        burn(work_us)
        socket.send(message)
    socket.close()
    context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work-us", type=float, default=68.0, help="busy work per worker and step")
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    scratch = tempfile.TemporaryDirectory(prefix="zmq-floor-")  # removed with the socket file at the end
    address = f"ipc://{scratch.name}/router.sock"
    router.bind(address)
    identities = [b"w%d" % i for i in range(args.workers)]
    spawn = mp.get_context("spawn")
    processes = [spawn.Process(target=worker, args=(address, i, args.work_us)) for i in identities]
    for p in processes:
        p.start()
    for _ in identities:
        router.recv_multipart()
    payload = b"a" * 200

    def step() -> None:
        for identity in identities:
            router.send_multipart([identity, payload])
        for _ in identities:
            router.recv_multipart()

    for _ in range(500):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = (time.perf_counter() - start) / args.steps
    for identity in identities:
        router.send_multipart([identity, b"stop"])
    for p in processes:
        p.join()
    router.close()
    context.term()
    scratch.cleanup()
    overhead = elapsed * 1e6 - args.work_us
    print(
        f"{args.workers} worker(s), {args.work_us:g} us work each: {elapsed * 1e6:.1f} us per lockstep step "
        f"({overhead:.1f} us of it is ZeroMQ hand-offs)"
    )


if __name__ == "__main__":
    main()
