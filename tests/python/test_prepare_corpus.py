"""tools/prepare_corpus.py on a small made-up source: the split rule, the byte layout,
determinism, skipped documents and the errors."""

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "prepare_corpus.py"
spec = importlib.util.spec_from_file_location("prepare_corpus", SCRIPT)
prepare_corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_corpus)


def make_source(root: Path, n=60):
    docs = {}
    for i in range(n):
        rel = f"part{i % 3}/doc{i:02d}.rst"
        text = f"Document {i}\n{'=' * 10}\n\nSome words about item {i}.\n".encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
        docs[rel] = text
    (root / "extra").mkdir()
    (root / "extra" / "notes.txt.gz").write_bytes(gzip.compress(b"compressed notes\n"))
    docs["extra/notes.txt.gz"] = b"compressed notes\n"
    (root / "extra" / "page.html").write_bytes(b"<p>not a document</p>")
    (root / "extra" / "binary.txt").write_bytes(b"has a \0 byte")
    return docs


def test_split_layout_and_determinism(tmp_path):
    docs = make_source(tmp_path / "src")
    m = prepare_corpus.prepare(tmp_path / "src", tmp_path / "out", 200)
    again = prepare_corpus.prepare(tmp_path / "src", tmp_path / "out2", 200)
    for split in ("train", "val"):
        data = (tmp_path / "out" / f"{split}.bin").read_bytes()
        assert data == (tmp_path / "out2" / f"{split}.bin").read_bytes()
        assert m[split] == again[split]
        assert m[split]["sha256"] == hashlib.sha256(data).hexdigest()
        # The rule, re-derived: documents in path order, each followed by a NUL byte.
        want = b"".join(text + b"\0" for rel, text in sorted(docs.items())
                        if (prepare_corpus.fnv1a64(rel.encode()) % 1000 < 200) == (split == "val"))
        assert data == want
    assert m["train"]["documents"] + m["val"]["documents"] == len(docs)
    assert m["val"]["documents"] > 0 and m["train"]["documents"] > 0
    assert m["skipped_with_nul"] == ["extra/binary.txt"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["val_permille"] == 200


def test_fnv1a64_is_the_standard_hash():
    assert prepare_corpus.fnv1a64(b"") == 0xCBF29CE484222325
    assert prepare_corpus.fnv1a64(b"a") == 0xAF63DC4C8601EC8C


def test_a_split_left_empty_or_a_bad_argument_is_an_error(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "only.rst").write_bytes(b"one document\n")
    with pytest.raises(SystemExit, match="both splits need at least one"):
        prepare_corpus.prepare(tmp_path / "src", tmp_path / "out", 20)
    with pytest.raises(SystemExit):
        prepare_corpus.main(["--source", str(tmp_path / "src"), "--val-permille", "0"])
    assert "--val-permille: expected 1 to 999, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_corpus.main(["--source", str(tmp_path / "missing")])
    assert "argument --source: expected a folder of documents" in capsys.readouterr().err
