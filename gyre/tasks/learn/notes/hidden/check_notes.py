"""Score a notes workspace (run by the evaluator in a scratch copy; prints the score last).

A note is a file that is new or changed compared with the initial workspace. Each note earns
0.25, and 0.75 more when it is a markdown bullet: its text starts with "-" and holds at
least three more characters. Two notes earn the full score: min(1, credit / 2).

    python3 check_notes.py --initial TASK/workspace      # in the workspace to score
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NOTES_FOR_FULL_SCORE = 2


def notes(root: Path, initial: Path) -> list[str]:
    """Texts of the files under `root` that are not identical to the initial workspace."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        before = initial / rel
        data = path.read_bytes()
        if before.is_file() and before.read_bytes() == data:
            continue
        out.append(data.decode("utf-8", errors="replace"))
    return out


def is_bullet(text: str) -> bool:
    return text.startswith("-") and len(text.strip()) >= 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial", type=Path, required=True)
    args = ap.parse_args()
    texts = notes(Path.cwd(), args.initial)
    bullets = sum(is_bullet(t) for t in texts)
    credit = 0.25 * len(texts) + 0.75 * bullets
    print(json.dumps({"notes": len(texts), "bullets": bullets}))
    print(min(1.0, credit / NOTES_FOR_FULL_SCORE))


if __name__ == "__main__":
    main()
