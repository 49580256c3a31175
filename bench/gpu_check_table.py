#!/usr/bin/env python
"""The table of a ``bench/gpu_check.sh run``: issue 36's figures from the JSON files it leaves in a folder.

    python bench/gpu_check_table.py OUT_DIR

Per archive (the yardstick, the 1-degree weather-model archive): the GPU yardstick's cold and warm epochs
with ``decode="cpu"``, ``"gpu"`` and ``"auto"`` (samples/s) and whether every output was bit-identical to
numpy; ``bench/gpu_bench.py``'s cold epochs (median of 3) with the ratios the issue targets (GPU over CPU,
auto over the faster of the two), what ``"auto"`` chose and why, and the device tier against a
device-to-device copy of the same bytes; kvikio's reads. Missing files (a step skipped or failed) are
said as such."""

from __future__ import annotations

import json
import os
import sys

ARCHIVES = {"yardstick": "the yardstick archive", "1deg": "the 1-degree weather-model archive"}
TARGETS = {"yardstick": (1.0, 100_000), "1deg": (2.0, None)}  # cold GPU over CPU at least; device tier samples/s


def _load(d: str, name: str) -> dict | None:
    try:
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _equal(check: dict) -> str:
    c = check.get("correctness")
    if not isinstance(c, dict) or "error" in c:
        return "-" if c is None else f"error: {c.get('error', '')[:80]}"
    flags = {k: v for k, v in c.items() if k.endswith("_equal")}
    bad = [k for k, v in flags.items() if v is not True]
    return "all bit-identical" if not bad else "DIFFERS: " + ", ".join(bad)


def main(d: str) -> int:
    lines = []
    for key, label in ARCHIVES.items():
        lines.append(f"== {label}")
        lines.append(f"{'decode':7s} {'numpy cold':>11s} {'cuda cold':>10s} {'cupy cold':>10s} {'cuda warm':>10s}"
                     "  outputs")
        for dec in ("cpu", "gpu", "auto"):
            check = _load(d, f"check_{key}_{dec}.json")
            if check is None:
                lines.append(f"{dec:7s} (not run)")
                continue
            t = check.get("throughput", {})
            if "error" in t:
                lines.append(f"{dec:7s} throughput error: {t['error'][:100]}")
                continue
            lines.append(f"{dec:7s} {t.get('numpy_cold', '-'):>11} {t.get('torch_cuda_cold', '-'):>10} "
                         f"{t.get('cupy_cold', '-'):>10} {t.get('torch_cuda_warm', '-'):>10}  {_equal(check)}")
        bench = _load(d, f"gpu_bench_{key}.json")
        e = (bench or {}).get("epochs")
        if not isinstance(e, dict) or "error" in e:
            lines.append(f"gpu_bench epochs: {'not run' if e is None else e.get('error', '')[:200]}")
            continue
        r = e.get("ratios", {})
        want_ratio, want_tier = TARGETS[key]
        lines.append(f"cold epochs, median of 3 (samples/s): cpu {e.get('cold_cpu_decode')}, gpu "
                     f"{e.get('cold_gpu_decode')}, auto {e.get('cold_auto_decode')}; gpu/cpu "
                     f"{r.get('cold_gpu_over_cpu')} (target >= {want_ratio}), auto/faster "
                     f"{r.get('cold_auto_over_faster')} (target >= 0.9)")
        lines.append(f"auto chose: {e.get('auto_chose')}")
        tier = e.get("warm_device_tier")
        lines.append(f"device tier: {tier} samples/s" + (f" (target >= {want_tier})" if want_tier else "")
                     + f", {r.get('warm_tier_over_d2d_copy')}x a device-to-device copy (target >= 0.8 on 1deg); "
                     f"host memory tier {e.get('warm_numpy_host')}")
        dec = (bench or {}).get("decode")
        if isinstance(dec, dict):
            lines.append("nvCOMP vs numcodecs: " + json.dumps(dec)[:400])
    kv = (_load(d, "gpu_bench_kvikio.json") or {}).get("kvikio")
    lines.append("== kvikio: " + ("not run" if kv is None else json.dumps(kv)[:600]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp/out")))
