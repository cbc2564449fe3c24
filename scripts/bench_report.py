#!/usr/bin/env python3
"""Render bench JSONs (from `dart-ray bench --out`) as markdown sections for docs/BENCHMARKS.md."""

import json
import sys
from pathlib import Path

from dart_ray.bench.runner import format_table


def main(paths: list[str]) -> None:
    for p in paths:
        rep = json.loads(Path(p).read_text())
        c = rep["config"]
        print(f"### {Path(p).stem}: {c['n_prompts']} prompts, bs {c['batch_size']}, {c['dtype']}, "
              f"{c['max_new_tokens']} new tokens, {c['threads']} threads, chat={c['chat']}\n")
        print(format_table(rep))
        lines = []
        for m, d in rep["methods"].items():
            if d.get("accepted_per_depth"):
                acc = ", ".join(f"{a:.2f}" for a in d["accepted_per_depth"][:8])
                lines.append(f"- {m}: {acc}")
        if lines:
            print("\nAcceptance rate per tree depth (fraction of steps accepting depth i):\n")
            print("\n".join(lines))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
