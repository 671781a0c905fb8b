"""The trained predictor's predictions on the ShareGPT test split, one JSON line
per pair: the simulator replays them so that EconoServe is scheduled with the
predictor's real errors, not an oracle's.

    python -m studies.econoserve_sim.predictions   # ~4 min on 1 CPU core
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from predictor.dataset import load_sharegpt_splits
from predictor.service import PredictorService

OUT = Path(__file__).parent / "test_predictions.jsonl"


def main() -> None:
    torch.set_num_threads(1)
    test = load_sharegpt_splits().test
    svc = PredictorService(max_batch_size=32)
    t0 = time.perf_counter()
    preds: list[int] = []
    for s in range(0, len(test), 256):
        part = test[s:s + 256]
        preds += svc.predict_lengths([p.prompt for p in part], [p.prompt_tokens for p in part])
        print(f"{len(preds)}/{len(test)} {time.perf_counter() - t0:.0f}s", flush=True)
    with OUT.open("w") as f:
        for p, n in zip(test, preds):
            f.write(json.dumps({"id": p.id, "prompt_tokens": p.prompt_tokens,
                                "response_len": p.response_len, "predicted_len": n}) + "\n")
    print(f"wrote {OUT} ({len(preds)} pairs)")


if __name__ == "__main__":
    main()
