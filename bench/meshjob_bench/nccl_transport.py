"""Cross-mesh resharding over NCCL on a GPU against gloo on the CPU, same plans, same executor.

A device check, not a figure of the paper: `bench/gpu_check.sh` runs it on a lent GPU machine
(`python -m meshjob_bench.nccl_transport --out DIR`). Between (2,4) meshes (two hosts of four devices
each side), each strategy's plan runs on one gang twice: device tensors over NCCL (meshjob_trainer.wire.NcclWire)
and CPU tensors over gloo. With one GPU every rank is an NCCL host of its own
(meshjob_trainer.dist.nccl_host_id), so NCCL's messages take its socket transport over loopback: no NIC is
emulated, and the times compare the strategies and the transports on this machine only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec, tile, to_index
from meshjob.network.model import NetworkModel
from meshjob.plan.build import plan_boundary
from meshjob.schedule.boundary import BoundaryKey
from meshjob.spec.manifest import ReshardingSpec
from meshjob_bench.machine import machine
from meshjob_trainer.launch import launch

SRC, DST = Mesh.grid((2, 4), 0, 0), Mesh.grid((2, 4), 8, 2)
CASES = {"S0R -> RR": ("S0R", "RR"), "RS1 -> S1R": ("RS1", "S1R"), "S01R -> RS01": ("S01R", "RS01")}  # (send, recv)
STRATEGY_NAMES = ("send_recv", "local_allgather", "global_allgather", "broadcast")
NIC_BYTES_PER_S = 25e9 / 8  # the planners' and the engine's NIC rate: 25 Gbit/s, above what loopback sockets
# carry here, so the engine's pacing (it holds a large send until the link's last one is nearly done at
# this rate) does not bind and the times are the transports'
NETWORK = NetworkModel(nic_bytes_per_s=NIC_BYTES_PER_S, intra_host_bytes_per_s=4 * NIC_BYTES_PER_S)


host_of = {r: h for m in (SRC, DST) for r, h in zip(m.ranks, m.hosts)}.__getitem__


def boundaries(shape: tuple[int, int], chunks: int) -> list[Any]:
    out = []
    for i, (name, (send, recv)) in enumerate(CASES.items()):
        for strategy in STRATEGY_NAMES:
            key = BoundaryKey(0, 1, f"{i}:{strategy}")
            out.append(
                (
                    name,
                    strategy,
                    plan_boundary(
                        key,
                        shape,
                        (SRC, ShardingSpec.parse(send)),
                        (DST, ShardingSpec.parse(recv)),
                        ReshardingSpec(strategy, chunks, "load_balance"),
                        host_of,
                        NIC_BYTES_PER_S,
                    ),
                )
            )
    return out


def measure(env: Any, shape: tuple[int, int], chunks: int, repeats: int, transports: list[str]) -> dict[str, Any]:
    """One rank: every (case, strategy) on each transport in turn (nccl: CUDA tensors, gloo: CPU ones);
    each repetition starts after a barrier and ends when this rank's part is done. Returns this rank's
    seconds per run."""
    # in the forked rank only: the benchmark module imports without torch and the trainer (`meshjob bench --help`)
    import torch
    import torch.distributed as dist

    from meshjob_trainer.dist import device_sync, init_distributed, shutdown_distributed
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.route import make_routes

    init_distributed(env, timeout_s=300, backend=None if "nccl" in transports else "gloo")
    try:
        cpu_group = dist.new_group(backend="gloo")
        planned = boundaries(shape, chunks)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {}
        exact = True
        for transport in transports:
            device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
            sync = device_sync(device)
            routes = [
                r
                for name, (send, recv) in CASES.items()
                for r in make_routes(
                    [b for n, _s, b in planned if n == name], {0: SRC, 1: DST}, {0: send, 1: recv}, NETWORK
                )
            ]
            ex = ReshardExecutor(
                None,
                env.rank,
                routes=routes,
                device=device,
                order=None,
                cpu_wire="gloo" if transport == "nccl" else transport,
            )
            for name, strategy, b in planned:
                mine = None
                if env.rank in SRC.ranks:
                    region = tile(ShardingSpec.parse(CASES[name][0]), SRC.shape, shape, SRC.index_of(env.rank))
                    mine = full[to_index(region)].clone().to(device)
                for rep in range(repeats + 1):  # the first run connects and warms up, untimed
                    dist.barrier(group=cpu_group)
                    start = time.perf_counter()
                    got = ex.start(b.key, rep, mine).wait(timeout_s=300)
                    if sync is not None:
                        sync()
                    if rep:
                        times.setdefault(f"{name}|{strategy}|{transport}", []).append(time.perf_counter() - start)
                if env.rank in DST.ranks:
                    region = tile(ShardingSpec.parse(CASES[name][1]), DST.shape, shape, DST.index_of(env.rank))
                    want = full[to_index(region)]
                    exact = exact and got is not None and torch.equal(got.cpu(), want)
            ex.close()
        dist.barrier(group=cpu_group)  # rank 0 hosts the store: it leaves last
        return {"times": times, "exact": exact}
    finally:
        shutdown_distributed()


def summarise(per_rank: list[dict[str, Any]], shape: tuple[int, int], chunks: int, repeats: int) -> dict[str, Any]:
    """A run's time is its slowest rank's; the median over repetitions stands for the row."""
    keys = per_rank[0]["times"].keys()
    rows = []
    for key in keys:
        name, strategy, transport = key.split("|")
        runs = [max(r["times"][key][i] for r in per_rank) for i in range(repeats)]
        rows.append(
            {
                "case": name,
                "strategy": strategy,
                "transport": transport,
                "median_s": statistics.median(runs),
                "runs_s": runs,
            }
        )
    by = {(r["case"], r["strategy"], r["transport"]): r["median_s"] for r in rows}
    for r in rows:
        r["over_broadcast"] = r["median_s"] / by[(r["case"], "broadcast", r["transport"])]
        nccl, gloo = (by.get((r["case"], r["strategy"], t)) for t in ("nccl", "gloo"))
        r["nccl_over_gloo"] = nccl / gloo if nccl is not None and gloo is not None else None
    return {
        "shape": list(shape),
        "bytes": shape[0] * shape[1] * 4,
        "chunks": chunks,
        "repeats": repeats,
        "src_mesh": list(SRC.shape),
        "dst_mesh": list(DST.shape),
        "exact": all(r["exact"] for r in per_rank),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32, square-ish 2-D)")
    parser.add_argument("--chunks", type=int, default=8, help="broadcast chunks per unit task")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--transports",
        default="nccl,gloo",
        help="comma-separated: nccl (needs a GPU), gloo or tcp (CPU tensors over that wire)",
    )
    args = parser.parse_args(argv)

    cols = 4096
    shape = (args.mib * 2**20 // 4 // cols, cols)
    world = SRC.size + DST.size
    transports = args.transports.split(",")
    # one torch thread per rank (the launcher's default): a forked rank that inherits the parent's thread pool
    # hangs in its first parallel op (seen in CI, where pytest's process had run torch before)
    result = launch(world, lambda ctx: measure(ctx.env, shape, args.chunks, args.repeats, transports), timeout_s=900)
    summary = summarise(result.raise_on_failure().values, shape, args.chunks, args.repeats)
    summary["machine"] = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nccl_transport.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.mib} MiB, (2,4) -> (2,4), broadcast K={args.chunks}, exact on every receiver: {summary['exact']}")
    print(f"{'case':<14} {'strategy':<17} {'transport':<9} {'ms':>8} {'/ broadcast':>11} {'nccl / gloo':>11}")
    for r in summary["rows"]:
        ratio = "" if r["nccl_over_gloo"] is None else f"{r['nccl_over_gloo']:.2f}"
        print(
            f"{r['case']:<14} {r['strategy']:<17} {r['transport']:<9} {r['median_s'] * 1e3:8.1f} "
            f"{r['over_broadcast']:11.2f} {ratio:>11}"
        )
    return 0 if summary["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
