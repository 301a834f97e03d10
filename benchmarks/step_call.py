"""The step's call to the draft actor: Ray against the actor's Unix socket.

A Ray actor pinned to the draft's core answers a small ``propose``-sized call
(a 300-token context in, one 4-token draft out) at once, through Ray and over
:mod:`duo_vllm.runtime.channel`, from a caller pinned to the target's core; idle, and
beside a thread that keeps the actor's core busy with GIL-free matrix
products (as llama.cpp's decode calls do). Round trips in ms, medians of
``--calls`` calls 20 ms apart (a vLLM step's pace).

    python -m benchmarks.step_call --caller-core 0 --actor-core 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


def make_actor(ray, core: int, busy: bool):
    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self):
            os.sched_setaffinity(0, {core})
            self.busy = busy
            if busy:
                threading.Thread(target=self._spin, daemon=True).start()
            self.server = None

        def _spin(self):
            import numpy as np

            a = np.random.rand(256, 256).astype(np.float32)
            while True:
                a @ a  # releases the GIL, as a llama.cpp call does

        def open_channel(self):
            from duo_vllm.runtime.channel import ChannelServer

            self.server = self.server or ChannelServer(self)
            return self.server.address, self.server.authkey

        def propose(self, context, budgets):
            return [[1, 2, 3, 4] for _ in budgets]

    return Echo.remote()


def round_trips(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
        time.sleep(0.02)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caller-core", type=int, default=0)
    ap.add_argument("--actor-core", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import ray

    from duo_vllm.runtime.channel import Channel

    os.sched_setaffinity(0, {args.caller_core})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", object_store_memory=128 * 1024 * 1024)
    context = list(range(300))
    for busy in (False, True):
        actor = make_actor(ray, args.actor_core, busy)
        channel = Channel(*ray.get(actor.open_channel.remote()))
        for r in range(args.rounds):
            for how, call in (
                    ("ray", lambda: ray.get(actor.propose.remote(context, [4]))),
                    ("socket", lambda: channel.get(channel.submit("propose", context, [4])))):
                ts = sorted(round_trips(call, args.calls))
                print(f"{'busy' if busy else 'idle'} round {r} {how:6s} median "
                      f"{1e3 * statistics.median(ts):.3f} ms, p90 "
                      f"{1e3 * ts[int(0.9 * len(ts))]:.3f} ms", flush=True)
        channel.close()
        ray.kill(actor)
    ray.shutdown()


if __name__ == "__main__":
    main()
