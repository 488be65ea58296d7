"""Push/pull throughput of the parameter server next to raw pyzmq, measured in one run.

Two gradient sets: ResNet-50's (161 tensors, 25.6 M parameters, many of
them small) and a large-message set (24 tensors of 4 MiB, one key each).
Each configuration runs as a real local cluster (``bpslaunch --local``);
the raw baseline is two processes echoing 4 MiB multipart messages (header
+ one raw frame, ``copy=False``) over loopback TCP, 8 in flight.

    python benchmarks/ps.py                     # 1x1 and 2x2, dense and ADTopk
    python benchmarks/ps.py --rounds 3 --quick  # a short run
    python benchmarks/ps.py --device cuda       # gradients on GPUs: compression there too

With ``--device cuda`` worker i's gradients live on GPU i mod the GPUs visible
(several workers may share one), so every push compresses on the GPU and
copies its payload to the host, as a GPU worker's do.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MB = 1 << 20


def resnet50_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


GRADIENT_SETS = {"resnet50": resnet50_shapes, "large": lambda: [(1024, 1024)] * 24}


# --- roles run by this script itself -------------------------------------------------

def worker_job(args: argparse.Namespace) -> None:
    """Inside a cluster: push_pull the whole gradient set for some rounds, print JSON."""
    import torch

    from adtopk_ps.client.ps_client import PSClient
    from adtopk_ps.compression import SparsificationPolicy, create
    from adtopk_ps.core.timing import wait_for_device

    torch.set_num_threads(1)
    client = PSClient()
    device = torch.device("cuda", client.rank % torch.cuda.device_count()) \
        if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton's kernels and the CUDA context follow it
    grads = [torch.randn(s).to(device) for s in GRADIENT_SETS[args.set]()]
    comp = None if args.compressor == "none" else create(args.compressor, ratio=args.ratio)
    routes = SparsificationPolicy(args.ratio).plan((f"g{i}", g) for i, g in enumerate(grads))

    def one_round() -> None:
        handles = [client.push_pull(g, f"g{i}", None if routes[f"g{i}"].dense else comp)
                   for i, g in reversed(list(enumerate(grads)))]
        for h in handles:
            h.wait()
        wait_for_device(device)  # answers copied back to a GPU have landed

    one_round()  # declares every key and allocates the servers' buffers
    client.barrier()
    pushed0, pulled0 = client.bytes_pushed, client.bytes_pulled
    start = time.perf_counter()
    for _ in range(args.rounds):
        one_round()
    wall = time.perf_counter() - start
    client.barrier()
    print("RESULT " + json.dumps({"rank": client.rank, "wall": wall, "rounds": args.rounds,
                                  "pushed": client.bytes_pushed - pushed0,
                                  "pulled": client.bytes_pulled - pulled0}), flush=True)
    client.shutdown()


def echo_server(port_file: str) -> None:
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    with open(port_file, "w") as f:
        f.write(str(port))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2:  # [identity, b"stop"]
            return
        sock.send_multipart(frames, copy=False)


# --- the driver ------------------------------------------------------------------------

def raw_pyzmq(total_bytes: int, message_bytes: int, inflight: int) -> float:
    """Bytes per second both ways through a pyzmq echo in another process."""
    import tempfile

    import msgpack
    import numpy as np
    import zmq
    port_file = tempfile.mktemp()
    echo = subprocess.Popen([sys.executable, __file__, "--echo", port_file])
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            time.sleep(0.05)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{open(port_file).read()}")
        payload = np.random.default_rng(0).standard_normal(message_bytes // 4, dtype=np.float32)
        header = msgpack.packb({"op": "push", "key": 0, "count": payload.size})
        count = max(inflight, total_bytes // message_bytes)
        sock.send_multipart([header, memoryview(payload)], copy=False)  # warm up the connection
        sock.recv_multipart(copy=False)
        start = time.perf_counter()
        sent = received = 0
        while received < count:
            while sent < count and sent - received < inflight:
                sock.send_multipart([header, memoryview(payload)], copy=False)
                sent += 1
            sock.recv_multipart(copy=False)
            received += 1
        wall = time.perf_counter() - start
        sock.send_multipart([b"stop"])
        return 2 * count * message_bytes / wall
    finally:
        echo.wait(10)
        os.unlink(port_file)


def ps_run(workers: int, servers: int, grads: str, compressor: str, ratio: float,
           rounds: int, keys: str | None = None, device: str = "cpu") -> dict:
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(workers),
           "--num-servers", str(servers), "--timeout", "900", "--", sys.executable, __file__,
           "--worker", "--set", grads, "--compressor", compressor, "--ratio", str(ratio),
           "--rounds", str(rounds), "--device", device]
    env = {**os.environ, **({"PS_CURVE_KEYS": keys} if keys else {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
               if "RESULT " in line]
    if out.returncode != 0 or len(results) != workers:
        raise RuntimeError(f"cluster run failed ({out.returncode}):\n{out.stdout[-3000:]}")
    wall = max(r["wall"] for r in results)
    moved = sum(r["pushed"] + r["pulled"] for r in results)
    return {"rounds_per_s": rounds / wall, "bytes_per_s": moved / wall,
            "pushed_per_round": results[0]["pushed"] / rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--compressor", default="adtopk")
    ap.add_argument("--quick", action="store_true", help="only the 1x1 dense run and the baseline")
    ap.add_argument("--curve", action="store_true",
                    help="also run the large-message set with CURVE on every socket")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the workers' gradients live (cuda: worker i on GPU i mod the GPUs visible)")
    ap.add_argument("--set", default="resnet50", choices=sorted(GRADIENT_SETS), help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--echo", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_job(args)
    if args.echo:
        return echo_server(args.echo)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("ps benchmark: --device cuda, but torch sees no GPU here")
    nparams = sum(__import__("math").prod(s) for s in resnet50_shapes())
    print(f"ResNet-50 gradient set: {len(resnet50_shapes())} tensors, {nparams / 1e6:.1f} M "
          f"parameters, {nparams * 4 / MB:.0f} MiB in fp32\n")
    raw = raw_pyzmq(400 * MB, 4 * MB, 8)
    print(f"raw pyzmq loopback echo (4 MiB frames, 8 in flight): {raw / 1e9:.2f} GB/s both ways\n")
    print(f"workers' gradients on {'GPUs' if args.device == 'cuda' else 'the CPU'}\n")
    print("| gradients | W x S | compressor | rounds/s | payload GB/s | vs raw pyzmq "
          "| pushed per worker-round |")
    print("|---|---|---|---:|---:|---:|---:|")
    configs = [("large", 1, 1, "none")] if args.quick else [
        ("large", 1, 1, "none"), ("large", 2, 2, "none"),
        ("resnet50", 1, 1, "none"), ("resnet50", 2, 2, "none"),
        ("resnet50", 1, 1, args.compressor), ("resnet50", 2, 2, args.compressor)]
    keys = None
    if args.curve:
        import tempfile

        from adtopk_ps.cluster.security import keygen
        keys = str(keygen(tempfile.mkdtemp()).parent)
        configs += [("large", 1, 1, "none", keys), ("large", 2, 2, "none", keys)]
    for grads, w, s, comp, *secured in configs:
        r = ps_run(w, s, grads, comp, args.ratio, args.rounds, secured[0] if secured else None,
                   device=args.device)
        label = (comp if comp == "none" else f"{comp} {args.ratio}") + (" + CURVE" if secured else "")
        print(f"| {grads} | {w} x {s} | {label} | {r['rounds_per_s']:.2f} | "
              f"{r['bytes_per_s'] / 1e9:.2f} | {r['bytes_per_s'] / raw:.0%} | "
              f"{r['pushed_per_round'] / MB:.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()
