"""The table of `emulated.sh`'s runs: per rule, with and without async scheduling, each
round's output tokens/s, iterations, preemptions and swap-outs, the emulated device's
utilization, and TTFT.

    python -m studies.engine_gpu.emulated_table studies/engine_gpu/emulated
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from studies.engine_gpu.host_path_table import rows

_NAME = re.compile(r"(?P<rule>\w+?_\w+?)_(?P<mode>sync|ahead)_(?P<round>\d+)\.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    print("| rule | scheduling | output tok/s | iterations | preemptions, swap-outs | "
          "device busy | TTFT P50 / P99 s | all finished, blocks free |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (rule, mode), runs in rows(a.folder, _NAME, ("rule", "mode")).items():
        ok = all(r["all_finished"] and r["free_blocks_after"] == r["num_blocks"]
                 and r["host_free_blocks_after"] == r["host_blocks"] for r in runs)
        cells = [
            " / ".join(f"{r['output_tokens_per_s']:,.0f}" for r in runs),
            " / ".join(f"{r['iterations']:,}" for r in runs),
            " / ".join(f"{r['preemptions']:,}, {r['swap_outs']:,}" for r in runs),
            " / ".join(f"{r['device_utilization']:.0%}" for r in runs),
            " / ".join(f"{r['ttft_s']['p50']:.1f} / {r['ttft_s']['p99']:.1f}" for r in runs),
        ]
        print(f"| {rule.replace('_', ', ')} | {mode} | " + " | ".join(cells)
              + f" | {'yes' if ok else 'no'} |")


if __name__ == "__main__":
    main()
