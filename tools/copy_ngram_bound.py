#!/usr/bin/env python3
"""Exact match on 000's Copy task for a copier that addresses the input by content alone.

At output step t the copier takes the last k tokens it produced (all of them correct so far),
finds where those k tokens occur in the input, and copies the token after the most recent
occurrence (stick-breaking's preference; --first: the first). The first k steps reach back to
the separator, whose context is unique, so they are exact. A sequence is copied exactly when
every step finds its own position; per-token accuracy counts the steps that do, each given the
correct tokens before it (teacher forcing, as the studies score it). This is what any mechanism that locates the source by the
preceding k tokens, with no notion of position, can reach: how long a context k the copier
needs for a given exact match at a given length, over a vocabulary of --vocab symbols (000: 32).

    python3 tools/copy_ngram_bound.py                      # k = 1..8, n = 64 .. 4096
    python3 tools/copy_ngram_bound.py --lengths 64 256 --json bound.json
"""
import argparse
import json
import random


def copied(x, k, first):
    """The steps copied right, given the correct tokens before each (teacher forcing)."""
    source = {}  # the k tokens before position p -> p (the most recent, or the first, p)
    for p in range(k, len(x)):
        context = tuple(x[p - k:p])
        if not first or context not in source:
            source[context] = p
    return min(k, len(x)) + sum(source[tuple(x[t - k:t])] == t for t in range(k, len(x)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--trials", type=int, default=2000, help="sequences per cell (a quarter beyond n = 1024)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--first", action="store_true", help="copy after the first occurrence instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.vocab < 2 or args.k_max < 1 or args.trials < 1 or min(args.lengths) < 1:
        ap.error("--vocab >= 2, --k-max >= 1, --trials >= 1 and lengths >= 1")

    rng = random.Random(args.seed)
    rows = []
    print("exact match / per-token accuracy (%) of a k-token content copier, vocabulary", args.vocab)
    print("k \\ n", *args.lengths, sep="\t")
    for k in range(1, args.k_max + 1):
        cells = []
        for n in args.lengths:
            trials = args.trials if n <= 1024 else max(1, args.trials // 4)
            exact = tokens = 0
            for _ in range(trials):
                right = copied([rng.randrange(args.vocab) for _ in range(n)], k, args.first)
                exact += right == n
                tokens += right / n
            cells.append({"n": n, "trials": trials, "exact_match": exact / trials, "accuracy": tokens / trials})
        rows.append({"k": k, "cells": cells})
        print(k, *(f"{100 * c['exact_match']:.1f} / {100 * c['accuracy']:.1f}" for c in cells), sep="\t")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "seed": args.seed, "occurrence": "first" if args.first else "most recent",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
