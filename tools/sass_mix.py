#!/usr/bin/env python3
"""Instruction mix of compiled kernels, by the pipe that issues them (static counts from SASS).

Which unit may bound a kernel can be read off its code before any GPU time is spent: e.g.
stick-breaking's forward has three special-function instructions (MUFU) per score against one
for softmax, and the special-function unit issues 16 a cycle per H100 multiprocessor against
about 4096 bf16 FLOPs on the matrix units. A pipe's share is a hypothesis about the bound,
not a measurement: moving stick-breaking's exp2 to the FMA pipe made it slower, since it is
bound by instruction issue (docs/performance.md, 2026-11-27). Static counts cover every
copy of a loop body (peeled rounds, masked and unmasked variants), so compare ratios between
instruction classes, not totals against run time; local loads and stores (LDL/STL) are spills.

    python3 tools/sass_mix.py src/cuda/stick_breaking.cu --kernel 'forward_sm90.*bfloat16Li64'
    python3 tools/sass_mix.py build.cubin --kernel keys_sm90 --loops 2 --top 12
    python3 tools/sass_mix.py src/cuda/threshold_attention_forward.cu --kernel 'forward_sm90.*bfloat16Li128.*TwoView' --products

--products counts what is issued around each cluster of warpgroup products (HGMMA, IGMMA within
80 instructions of each other), from 40 instructions before its first product to its last: the
products' operand descriptors are built there. R2UR among them means descriptors built in
ordinary registers and moved to uniform ones, two moves a descriptor (tile::warp_uniform in
src/cuda/tile/hopper.cuh says why and how to avoid it).

A .cu file is compiled to an sm_90a cubin first (nvcc, the repository's include paths).
cuobjdump comes from PATH, or from PyPI's nvidia-cuda-cuobjdump wheel (pip install
nvidia-cuda-cuobjdump) when the CUDA toolkit has none.
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# SASS opcode (before the first dot) -> the class it is counted under.
CLASSES = {
    "special function (MUFU)": {"MUFU"},
    "matrix (HGMMA, IGMMA, HMMA)": {"HGMMA", "IGMMA", "HMMA"},
    "fp32 (FADD, FMUL, FFMA)": {"FADD", "FMUL", "FFMA"},
    "fp32 compare/select (FMNMX, FSEL, FSETP)": {"FMNMX", "FSEL", "FSETP"},
    "integer (IMAD, IADD3, LOP3, SHF, ISETP, LEA)": {"IMAD", "IADD3", "LOP3", "SHF", "ISETP", "LEA", "IABS", "IMNMX"},
    "conversion (F2F, F2FP, F2I, I2F, FRND)": {"F2F", "F2FP", "F2I", "I2F", "FRND"},
    "shared memory (LDS, STS, LDSM)": {"LDS", "STS", "LDSM"},
    "global (LDG, STG, RED, ATOM)": {"LDG", "STG", "REDG", "RED", "ATOMG", "ATOM", "LDGSTS"},
    "spills (LDL, STL)": {"LDL", "STL"},
    "shuffles (SHFL)": {"SHFL"},
    "barriers (BAR, SYNCS, WARPGROUP)": {"BAR", "SYNCS", "WARPGROUP"},
    "to uniform registers (R2UR)": {"R2UR"},
}

PRODUCTS = {"HGMMA", "IGMMA"}


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site in sys.path:
        for path in glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump")):
            return path
    sys.exit("sass_mix.py: cuobjdump not found: put the CUDA toolkit's on PATH, or "
             "`pip install nvidia-cuda-cuobjdump`")


def cubin_of(source, arch, workdir):
    out = os.path.join(workdir, "kernels.cubin")
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-I", os.path.join(ROOT, "include"), "-I", os.path.join(ROOT, "src"), "-cubin", source, "-o", out]
    subprocess.run(cmd, check=True)
    return out


def kernels_of(sass):
    """{mangled name: [(address, opcode, text), ...]} from cuobjdump -sass text."""
    kernels, current = {}, None
    for line in sass.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = kernels.setdefault(header.group(1), [])
            continue
        op = re.match(r"\s*/\*([0-9a-f]+)\*/\s+((?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[^;]*)", line)
        if op and current is not None:
            current.append((int(op.group(1), 16), op.group(3), op.group(2)))
    return kernels


def loops_of(instructions, count):
    """The `count` longest loops, as (first address, last address): spans closed by a branch
    back to an earlier address. Branches placed after the kernel's last unconditional EXIT are
    out-of-line slow paths (barrier waits) returning into the body, not loops, and are left
    out; a loop's count covers every path through its body, both sides of each branch."""
    last_exit = max((a for a, op, text in instructions if op == "EXIT" and not text.startswith("@")), default=None)
    spans = []
    for address, op, text in instructions:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text) if op == "BRA" else None
        if target and int(target.group(1), 16) < address and (last_exit is None or address < last_exit):
            spans.append((int(target.group(1), 16), address))
    return sorted(set(spans), key=lambda s: s[0] - s[1])[:count]


def product_clusters(ops):
    """(first, last) indices of runs of warpgroup products no more than 80 instructions apart."""
    at = [i for i, op in enumerate(ops) if op in PRODUCTS]
    clusters = []
    for i in at:
        if clusters and i - clusters[-1][1] < 80:
            clusters[-1][1] = i
        else:
            clusters.append([i, i])
    return clusters


def print_mix(ops, indent):
    counts = collections.Counter(ops)
    for label, members in CLASSES.items():
        n = sum(counts[m] for m in members)
        if n:
            print(f"{indent}{n:7d}  {label}")
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a .cu file (compiled here) or a .cubin")
    parser.add_argument("--kernel", default=".", help="regular expression on the mangled kernel names")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent opcodes")
    parser.add_argument("--loops", type=int, default=0,
                        help="also the mix of the N longest loops (a main loop's count is per iteration)")
    parser.add_argument("--products", action="store_true",
                        help="also the instructions issued around each cluster of warpgroup products")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        cubin = cubin_of(args.input, args.arch, workdir) if args.input.endswith(".cu") else args.input
        sass = subprocess.run([find_cuobjdump(), "-sass", cubin], check=True, capture_output=True, text=True).stdout
    kernels = {name: ops for name, ops in kernels_of(sass).items() if re.search(args.kernel, name)}
    if not kernels:
        sys.exit(f"sass_mix.py: no kernel matches {args.kernel!r}")
    for name, instructions in sorted(kernels.items()):
        ops = [op for _, op, _ in instructions]
        print(f"{name}\n  {len(ops)} instructions")
        counts = print_mix(ops, "  ")
        if args.top:
            print("  most frequent: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
        if args.products:
            for first, last in product_clusters(ops):
                around = ops[max(0, first - 40):last + 1]
                products = sum(op in PRODUCTS for op in around)
                moves = sum(op == "R2UR" for op in around)
                print(f"  {products:3d} products at {instructions[first][0]:#x}: {len(around)} instructions, {moves} R2UR")
        for first, last in loops_of(instructions, args.loops):
            body = [op for a, op, _ in instructions if first <= a <= last]
            print(f"  loop {first:#x}..{last:#x}: {len(body)} instructions")
            counts = print_mix(body, "    ")
            if args.top:
                print("    most frequent: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
