"""Cost of the ordered reduction ([Note: ordered reduction] in `unbroken.train.ordered`) on the
demo's fault-free job: 4 CPU ranks (gloo), the all-reduce and the ordered reduction alternated
run by run in one session.

    PYTHONPATH=src python bench/ordered_reduction_cost.py [--repeats 3]

Prints each run's median iteration time, the median over runs of each variant, and the ratio
ordered / all-reduce.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

from unbroken.api import reference_config, run_job
from unbroken.config.demo import demo_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    base = reference_config(demo_config(args.quick))
    root = tempfile.mkdtemp(prefix="unbroken-reduce-")
    times: dict[str, list[float]] = {"allreduce": [], "ordered": []}
    for r in range(args.repeats):
        for mode, sink in times.items():
            parallel = dataclasses.replace(base.parallel, reduce=mode)
            s = run_job(dataclasses.replace(base, parallel=parallel), f"{root}/{mode}", quiet=True)
            sink.append(s["mean_iter_s"])
            print(f"{mode} #{r}: median iteration {sink[-1] * 1e3:.1f} ms", flush=True)
    med = {mode: statistics.median(v) for mode, v in times.items()}
    for mode, v in times.items():
        print(f"{mode}: {med[mode] * 1e3:.1f} ms (runs {[round(x * 1e3) for x in v]})")
    print(f"ordered / allreduce: {med['ordered'] / med['allreduce']:.3f}")


if __name__ == "__main__":
    main()
