"""Split the target's answers to the chat set and chat-probe (runs/evalsets, `make eval-answers`)
into writing requests (the prompt starts with write / compose / draft / create) and the rest, as
two evaluation-set directories scripts/eval_drafters.py reads (domains chat@writing, chat@other).
Seventeenth sitting, issue 17::

    .venv/bin/python docs/bench/r17zen4n/split_writing.py
    .venv/bin/python scripts/eval_drafters.py --eval-seqs 200 \\
        --data runs/s17/evalsets/writing,runs/s17/evalsets/other \\
        v10=runs/v11/v10-drafter v14=runs/v14/drafter/drafter
"""
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from dart_ray.training.gen_data import EVAL_MARKER

WRITING = re.compile(r"\s*(write|compose|draft|create)\b", re.I)
t = pa.concat_tables([pq.read_table(f"runs/evalsets/{s}/shard-00000.parquet")
                      for s in ("chat", "chat-probe")])
is_writing = [bool(WRITING.match(p)) for p in t.column("prompt").to_pylist()]
for name, keep in (("writing", is_writing), ("other", [not w for w in is_writing])):
    out = f"runs/s17/evalsets/{name}"
    os.makedirs(out, exist_ok=True)
    rows = t.filter(pa.array(keep))
    pq.write_table(rows, f"{out}/shard-00000.parquet")
    with open(f"{out}/{EVAL_MARKER}", "w") as f:    # evaluation answers: domain chat@NAME
        json.dump({"prompts": name}, f)
    print(name, rows.num_rows, "rows")
