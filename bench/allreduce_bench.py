#!/usr/bin/env python3
"""Time NCCL all-reduces of float32 buffers the size of the trainer's gradient buckets.

Launch with torchrun (one process per GPU), for instance:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 bench/allreduce_bench.py --mb 0.7,1,2,4,5.7,6.5

Each size: warm-up, then --repeats all-reduces, each timed alone with CUDA events (the GPU idle
otherwise, as the last bucket is after the backward pass); the median and the algorithm
bandwidth (bytes / time) are printed by rank 0. The NCCL_* environment variables in force are
printed with the table, so runs with different settings can be compared.
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="0.7,1,2,4,5.7,6.5", help="buffer sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--high-priority", action="store_true", help="NCCL's stream at high priority")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()

    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise SystemExit("set NCCL_NVLS_ENABLE=0 (NVLink multicast stays off on shared hosts)")
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = args.high_priority
    dist.init_process_group("nccl", pg_options=options, device_id=torch.device("cuda", local))

    rows = []
    for mb in (float(x) for x in args.mb.split(",")):
        n = int(mb * (1 << 20)) // 4
        buf = torch.ones(n, device="cuda")
        for _ in range(5):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(buf)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        us = statistics.median(times)
        rows.append({"mib": mb, "us": us, "algbw_gb_s": n * 4 / (us * 1e-6) / 1e9})
    if rank == 0:
        knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
        print("all-reduce, float32, world", dist.get_world_size(), "high priority", args.high_priority, knobs)
        for r in rows:
            print(f"  {r['mib']:6.2f} MiB  {r['us']:8.1f} us  {r['algbw_gb_s']:7.1f} GB/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": dist.get_world_size(), "env": knobs, "high_priority": args.high_priority,
                           "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
