"""The family's English text: the Python 3.11 documentation sources of Debian's python3.11-doc.

/usr/share/doc/python3.11/html/_sources/**/*.rst.txt holds 497 reStructuredText files (11 MB of
English technical prose with some markup and code). Each file is one document; a document goes
to exactly one split by a hash of its relative path (split by DOCUMENT, so held-out text never
shares a page with training or calibration text):

    sha256(path) % 20 == 0  -> heldout   (evaluation only)
    sha256(path) % 20 == 1  -> calib     (KV dumps for kvt fit)
    otherwise               -> train     (model training only)

    python3 eval/tinyfamily/corpus.py --out /tmp/tinyfamily-corpus   # writes {split}.jsonl
"""

import argparse
import glob
import hashlib
import json
import os

SOURCES = "/usr/share/doc/python3.11/html/_sources"
PACKAGE = "python3.11-doc"


def split_of(relpath):
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % 20
    return "heldout" if bucket == 0 else "calib" if bucket == 1 else "train"


def documents(root=SOURCES):
    """[(relpath, text)] sorted by path."""
    paths = sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True))
    if not paths:
        raise SystemExit(f"no *.rst.txt under {root}: install the Debian package {PACKAGE}")
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.append((os.path.relpath(path, root), f.read()))
    return out


def splits(root=SOURCES):
    result = {"train": [], "calib": [], "heldout": []}
    for rel, text in documents(root):
        result[split_of(rel)].append({"path": rel, "text": text})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", default=SOURCES)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, docs in splits(args.root).items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
        print(f"{name}: {len(docs)} documents, {sum(len(d['text'].encode()) for d in docs)} bytes")


if __name__ == "__main__":
    main()
