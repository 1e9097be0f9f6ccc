"""Compare the stock and strict reports of flowlock_strict_plugin: counts, then every test that passed
stock and not strict (with its first error line), then anything that passed only strict.

Usage: python compare.py STOCK.json STRICT.json. Exit 0 always: whether a difference is a deliberate
refusal is for the reader (docs/diffusers_suite.md lists the known ones).
"""

from __future__ import annotations

import collections
import json
import sys

PASSING = ("passed", "xpassed")


def _summary(tests: dict) -> str:
    counts = collections.Counter(t["outcome"] for t in tests.values())
    return ", ".join(f"{counts[k]} {k}" for k in ("passed", "xpassed", "failed", "error", "skipped", "xfailed")
                     if counts[k])


def main(stock_path: str, strict_path: str) -> None:
    stock, strict = (json.load(open(p)) for p in (stock_path, strict_path))
    for name, report in (("stock", stock), ("strict", strict)):
        print(f"{name:6s} (diffusers {report['diffusers']}, {report['diffusers_path']}): {_summary(report['tests'])}")
    s, t = stock["tests"], strict["tests"]
    passed = [k for k, v in s.items() if v["outcome"] in PASSING]
    kept = [k for k in passed if t.get(k, {}).get("outcome") in PASSING]
    print(f"stock passed {len(passed)} (passed or xpassed); of those strict passed {len(kept)}")
    lost = [k for k in passed if k not in kept]
    print(f"differences ({len(lost)}):")
    for k in lost:
        r = t.get(k, {"outcome": "missing", "message": ""})
        print(f"  {k}\n    {r['outcome']}: {r['message']}")
    gained = [k for k, v in t.items() if v["outcome"] in PASSING and k not in passed]
    if gained:
        print(f"passed strict only ({len(gained)}):")
        for k in gained:
            print(f"  {k} (stock: {s.get(k, {}).get('outcome', 'missing')})")
    unreached = [k for k in kept if t[k].get("patched", 0) and not t[k].get("strict_forwards", 0)]
    print(f"strict passes that patched a model but ran no strict forward: {len(unreached)}")
    for k in unreached:
        print(f"  {k}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
