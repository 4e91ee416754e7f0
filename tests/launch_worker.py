"""A training script for `keras-mgpu launch`: `backup_workers.train` with
the JSON keyword arguments of argv[1], its result written to
`<argv[2]>/worker<index>.json`.

Run by the launcher as `python tests/launch_worker.py '{...}' OUT_DIR`.
"""

import json
import os
import sys

# The repository root, not this script's folder: tests/jax would shadow
# the jax package.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests import backup_workers  # noqa: E402

result = backup_workers.train(**json.loads(sys.argv[1]))
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(os.path.join(sys.argv[2], f"worker{index}.json"), "w") as f:
    json.dump(result, f)
