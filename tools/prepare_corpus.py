#!/usr/bin/env python3
"""Builds winnow's language-modeling corpus: byte-level tokens (vocab 256) in a fixed
train / validation split.

    python3 tools/prepare_corpus.py                       # the Linux kernel's documentation
    python3 tools/prepare_corpus.py --source DIR --out data/corpus

The default source is the English documentation of the Linux kernel as Debian's `linux-doc`
package installs it (/usr/share/doc/linux-doc-*/Documentation: about 3,200 reStructuredText
and 1,900 plain-text files, 28.6 MB; GPL-2.0, the kernel's licence; `make corpus` installs the
package and runs this script). Nothing is downloaded here.

Every `.rst` and `.txt` file under the source (also gzip-compressed, `.rst.gz` / `.txt.gz`) is a
document; documents holding a NUL byte are skipped, since NUL separates documents in the
output. A document goes to the validation split when the 64-bit FNV-1a hash of its path
relative to the source, modulo 1000, is below `--val-permille` (default 20, about 2%), so the
split does not depend on the file system's order or on which other files exist. Each split
is its documents' bytes in the order of their relative paths, each followed by one NUL byte:
`train.bin` and `val.bin`, one byte a token. `manifest.json` records the source, the rule,
the document and byte counts and each file's SHA-256: the same source gives the same bytes.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

SUFFIXES = (".rst", ".txt", ".rst.gz", ".txt.gz")
SEPARATOR = b"\0"


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def default_source() -> Path | None:
    found = sorted(glob.glob("/usr/share/doc/linux-doc-*/Documentation"))
    return Path(found[-1]) if found else None


def documents(source: Path):
    """(relative path, bytes) of every document under source, in the order of the paths."""
    paths = []
    for root, _, files in os.walk(source):
        for name in files:
            if name.endswith(SUFFIXES):
                full = Path(root) / name
                paths.append((full.relative_to(source).as_posix(), full))
    for rel, full in sorted(paths):
        data = full.read_bytes()
        if rel.endswith(".gz"):
            data = gzip.decompress(data)
        yield rel, data


def prepare(source: Path, out: Path, val_permille: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": bytearray(), "val": bytearray()}
    counts = {"train": 0, "val": 0}
    skipped = []
    for rel, data in documents(source):
        if SEPARATOR in data:
            skipped.append(rel)
            continue
        split = "val" if fnv1a64(rel.encode()) % 1000 < val_permille else "train"
        splits[split] += data + SEPARATOR
        counts[split] += 1
    if counts["train"] == 0 or counts["val"] == 0:
        raise SystemExit(f"prepare_corpus: {source} gave {counts['train']} training and "
                         f"{counts['val']} validation documents; both splits need at least one "
                         f"(a source of .rst / .txt files, and --val-permille between 1 and 999)")
    manifest = {
        "source": str(source),
        "rule": f"document (.rst, .txt, .rst.gz, .txt.gz; no NUL byte) -> val when "
                f"fnv1a64(relative path) % 1000 < {val_permille}; documents in path order, "
                f"each followed by a NUL byte; one byte a token",
        "val_permille": val_permille,
        "skipped_with_nul": skipped,
    }
    for split, data in splits.items():
        path = out / f"{split}.bin"
        tmp = path.with_suffix(".bin.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        manifest[split] = {"documents": counts[split], "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=None,
                   help="folder of documents (default: the newest /usr/share/doc/linux-doc-*/Documentation)")
    p.add_argument("--out", type=Path, default=Path("data/corpus"), help="output folder (default data/corpus)")
    p.add_argument("--val-permille", type=int, default=20,
                   help="validation share in thousandths of the documents, 1 to 999 (default 20)")
    args = p.parse_args(argv)
    if not 1 <= args.val_permille <= 999:
        p.error(f"argument --val-permille: expected 1 to 999, got {args.val_permille}")
    source = args.source or default_source()
    if source is None or not source.is_dir():
        p.error(f"argument --source: expected a folder of documents, got "
                f"{source if source else 'none (Debian package linux-doc not installed: make corpus installs it)'}")
    m = prepare(source, args.out, args.val_permille)
    print(f"{args.out}: train {m['train']['documents']} documents, {m['train']['bytes'] / 1e6:.1f} MB; "
          f"val {m['val']['documents']} documents, {m['val']['bytes'] / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
