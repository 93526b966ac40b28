#!/usr/bin/env python3
"""Write tests/system-seconds.json from the JUnit report of a system run: each test file's
seconds (setup, call and teardown of its tests), which tests/conftest.py sorts the
workers' files by, the costliest first.

    .venv/bin/pytest -m system -n 2 --dist loadfile --junitxml=/tmp/system.xml
    scripts/system-seconds.py /tmp/system.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "system-seconds.json"


def main(report: str) -> None:
    seconds: defaultdict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        name = case.get("classname", "").split(".")[1] + ".py"  # tests.test_x[.Class]
        seconds[name] += float(case.get("time", "0"))
    costliest = sorted(seconds.items(), key=lambda item: -item[1])
    OUT.write_text(json.dumps({name: round(s, 1) for name, s in costliest}, indent=1) + "\n")
    print(f"{OUT}: {len(costliest)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
