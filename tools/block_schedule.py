#!/usr/bin/env python3
"""The idle tail of softmax's key-stationary backward grid, by a schedule model.

Each block owns 128 keys of one (kv head, sequence) and sweeps the 64-row query tiles that see
them (causal, q_len == k_len): key block kb of a sequence of L tokens does (L - 128 kb) / 64
tiles. Blocks start in the grid's linear order, each on the multiprocessor that frees first
(one block per multiprocessor), and cost their tiles plus a fixed per-block overhead in tiles.
Prints each order's finish time over the perfectly balanced one.

What the model leaves out: the L2. Starting every head's first key blocks first removes the
tail in this model but measured 40% slower at L = 8192 on an H100, because the blocks running
at once then read and reduce into every head's Q, dO and dQ instead of two or three heads'
(docs/performance.md, 2026-11-26).

    python3 tools/block_schedule.py --lengths 4096 8192 16384 32768 --tokens 32768 --heads 16
    python3 tools/block_schedule.py --screen --lengths 2048 4096 16384 --tokens 16384 --heads 12
"""
import argparse
import heapq


def finish_time(order, sms, overhead):
    free = [0.0] * sms
    for tiles in order:
        start = heapq.heappop(free)
        heapq.heappush(free, start + tiles + overhead)
    return max(free)


def grid_order(length, pairs, heads_per_sweep):
    """Tile counts in launch order when heads_per_sweep (head, sequence) pairs interleave."""
    key_blocks = length // 128
    work = [(length - 128 * kb) // 64 for kb in range(key_blocks)]
    order = []
    for first in range(0, pairs, heads_per_sweep):
        for kb in range(key_blocks):
            order.extend(work[kb] for _ in range(first, min(pairs, first + heads_per_sweep)))
    return order


def screen_items(length, pairs):
    """Key tiles (128 keys) of the int8 screen's items (128 query rows each, causal), heaviest
    first over all (sequence, head) pairs: the order its blocks start in."""
    tiles = length // 128
    return [tiles - t for t in range(tiles) for _ in range(pairs)]


def snake_finish(items, sms, overhead):
    """Block c takes item r sms + c in even rounds r and r sms + sms - 1 - c in odd ones."""
    load = [0.0] * sms
    for i, tiles in enumerate(items):
        r, c = divmod(i, sms)
        load[c if r % 2 == 0 else sms - 1 - c] += tiles + overhead
    return max(load)


def screen_table(args):
    """The screen's schedules: a block per item in the old grid's order (each pair's tiles,
    heaviest first, pair after pair), greedy over the heaviest-first order (the landed form since
    session 89, two blocks a multiprocessor: --sms 264), and the fixed snake of the resident
    blocks before it. Overhead is per item, in key tiles."""
    print("L      grid   greedy  snake   (finish over balanced)")
    for length in args.lengths:
        pairs = args.heads * max(1, args.tokens // length)
        items = screen_items(length, pairs)
        tiles = length // 128
        grid = [tiles - t for _ in range(pairs) for t in range(tiles)]
        balanced = sum(t + args.overhead for t in items) / args.sms
        cells = [finish_time(grid, args.sms, args.overhead), finish_time(items, args.sms, args.overhead),
                 snake_finish(items, args.sms, args.overhead)]
        print(f"{length:<6} " + "  ".join(f"{c / balanced:6.3f}" for c in cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--tokens", type=int, default=32768, help="B L")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=1.0, help="per-block cost in tiles")
    parser.add_argument("--interleave", type=int, nargs="+", default=[1, 2, 4],
                        help="(head, sequence) pairs whose key blocks interleave; 1 is the landed order")
    parser.add_argument("--screen", action="store_true",
                        help="threshold attention's int8 screen (query-tile items) instead of the backward")
    args = parser.parse_args()
    if args.screen:
        screen_table(args)
        return
    print("L      " + "  ".join(f"pairs {g}" for g in args.interleave) + "  all heads first")
    for length in args.lengths:
        pairs = args.heads * max(1, args.tokens // length)
        balanced = sum(t + args.overhead for t in grid_order(length, pairs, 1)) / args.sms
        cells = [finish_time(grid_order(length, pairs, g), args.sms, args.overhead) / balanced
                 for g in args.interleave + [pairs]]
        print(f"{length:<6} " + "  ".join(f"{c:7.3f}" for c in cells))


if __name__ == "__main__":
    main()
