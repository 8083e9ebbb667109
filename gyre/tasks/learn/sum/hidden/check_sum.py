"""Score a sum workspace (run by the evaluator in a scratch copy; prints the score last).

Four quarters of credit: some file is new or changed compared with the initial workspace;
a file named answer.txt exists; its stripped text is digits only; those digits are a + b.

    python3 check_sum.py --initial TASK/workspace A B      # in the workspace to score
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ANSWER = "answer.txt"


def changed(root: Path, initial: Path) -> list[Path]:
    """Files under `root` that are not identical to the initial workspace."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        before = initial / path.relative_to(root)
        if not (before.is_file() and before.read_bytes() == path.read_bytes()):
            out.append(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial", type=Path, required=True)
    ap.add_argument("a", type=int)
    ap.add_argument("b", type=int)
    args = ap.parse_args()
    root = Path.cwd()
    answer = root / ANSWER
    text = answer.read_text(errors="replace").strip() if answer.is_file() else ""
    digits = text.isdigit()  # False for ""
    parts = {
        "wrote": bool(changed(root, args.initial)),
        "named": answer.is_file(),
        "digits": digits,
        "right": digits and int(text) == args.a + args.b,
    }
    print(json.dumps(parts))
    print(sum(parts.values()) / len(parts))


if __name__ == "__main__":
    main()
