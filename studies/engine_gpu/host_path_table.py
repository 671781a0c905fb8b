"""The table of `host_path.sh`'s runs: per rule and young-collection threshold, each
round's host time per output token, its collections' seconds and longest pause, and
how many unreachable objects all of them freed.

    python -m studies.engine_gpu.host_path_table studies/engine_gpu/host_path
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_NAME = re.compile(r"(?P<rule>\w+?_\w+?)_young(?P<young>\d+)_(?P<round>\d+)\.json")


Runs = dict[tuple[str, str], list[dict[str, Any]]]


def rows(folder: Path, name: re.Pattern[str] = _NAME,
         keys: tuple[str, str] = ("rule", "young")) -> Runs:
    """Each configuration's runs (the groups `keys` of a file's `name`), in the
    order of their `round` group."""
    runs: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for path in folder.glob("*.json"):
        m = name.fullmatch(path.name)
        if m is not None:
            runs[(m[keys[0]], m[keys[1]])].append((int(m["round"]),
                                                   json.loads(path.read_text())))
    return {k: [r for _, r in sorted(v, key=lambda x: x[0])] for k, v in sorted(runs.items())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    print("| rule | young threshold | host µs a token | of which collecting (s) | "
          "longest pause (ms) | collections (young / middle / old) | objects they freed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    by_threshold = sorted(rows(a.folder).items(), key=lambda kv: (kv[0][0], int(kv[0][1])))
    for (rule, young), runs in by_threshold:
        us = " / ".join(f"{1e6 * r['loop_s'] / r['output_tokens']:.1f}" for r in runs)
        gc_s = " / ".join(f"{sum(r['gc']['seconds']):.2f}" for r in runs)
        longest = " / ".join(f"{1e3 * r['gc']['longest_s']:.0f}" for r in runs)
        counts = " / ".join(str(sum(r["gc"]["count"][i] for r in runs) // len(runs))
                            for i in range(3))
        freed = sum(sum(r["gc"].get("collected", [0])) for r in runs)
        print(f"| {rule.replace('_', ', ')} | {young} | {us} | {gc_s} | {longest} | {counts} "
              f"| {freed} |")


if __name__ == "__main__":
    main()
