"""Run the docs' drop-in blocks one after the other, as a script does: ``python -m tests.e2e.doc_block_runner
BLOCKS.json RESULTS.json`` (``tests/e2e/test_dropin_e2e.py``).  Each block runs in a fresh namespace named
``__main__``; what it built is dropped before the next (its actors end with their handles).  Per block the
runner records its seconds and the CPUs its config asks of Ray, by RLlib's own resource request: a
``Tuner`` trial reserves every bundle, ``build_algo()`` only the actors' (bundle 0 is this process)."""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any


def cpus_needed(config: Any, *, tuner: bool) -> float:
    one = config.copy(copy_frozen=False)
    if isinstance(one.lr, dict):  # a Tune search space: RLlib validates lr, so one value of it
        one.training(lr=1e-4)
    bundles = one.algo_class.default_resource_request(one).bundles
    return sum(b.get("CPU", 0.0) for b in (bundles if tuner else bundles[1:]))


def main(blocks_file: str, results_file: str) -> None:
    results = []
    for block in json.loads(Path(blocks_file).read_text()):
        start = time.monotonic()
        namespace: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(block["code"], block["key"], "exec"), namespace)
        seconds = time.monotonic() - start
        cpus = cpus_needed(namespace["config"], tuner="Tuner(" in block["code"])
        results.append({"key": block["key"], "seconds": seconds, "cpus": cpus})
        print(f"doc block {block['key']}: {seconds:.1f} s, {cpus} CPUs", flush=True)
        namespace.clear()
        gc.collect()
    Path(results_file).write_text(json.dumps(results))
    print(f"doc blocks done at {time.time()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
