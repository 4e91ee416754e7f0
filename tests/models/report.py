"""docs/models.md's table from the matrix's measurements.

    KERAS_MGPU_MATRIX_LOG=/tmp/matrix.jsonl make models   # or pytest ...
    python -m tests.models.report /tmp/matrix.jsonl

Each row: a model, a backend, and what each check measured (the largest
absolute weight difference against its reference, or the loss against
the float32-logit loss).
"""

from __future__ import annotations

import json
import sys

CHECKS = {
    "accumulation_window": "window vs reference",
    "accumulation_in_step": "in-step vs reference",
    "fp32_head_mixed_float16": "head loss, float16",
    "fp32_head_mixed_bfloat16": "head loss, bfloat16",
    "clipping": "sparse clipping",
    "sigkill_resume": "SIGKILL + resume",
    "save_load_export": "saved/loaded, served",
    "keras_accumulation_callbacks": "Keras accumulation + callbacks",
}


def _cell(check: str, rows: list) -> str:
    if not rows:
        return "-"
    if check.startswith("fp32_head"):
        row = rows[0]
        return f"{row['loss']:.6g} / {row['expected']:.6g}"
    if check == "clipping":
        worst = max(max(v for k, v in r.items() if k.endswith("window"))
                    for r in rows)
        return f"{worst:.1e} ({len(rows)} kinds)"
    if check == "save_load_export":
        row = rows[0]
        return f"{row['trained_on_diff']:.1e}, {row['served_diff']:.1e}"
    return f"{max(r['max_abs_diff'] for r in rows):.1e}"


def table(path: str) -> str:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    keys = sorted({(r["model"], r["backend"]) for r in records},
                  key=lambda k: (k[0], k[1]))
    header = ["model", "backend", *CHECKS.values()]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    for model, backend in keys:
        mine = [r for r in records
                if (r["model"], r["backend"]) == (model, backend)]
        cells = [_cell(check, [r for r in mine
                               if r["check"].startswith(check)])
                 for check in CHECKS]
        lines.append("| " + " | ".join([model, backend, *cells]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
