"""Fail CI on any skipped test that is not in .ci/allowed_skips.txt (one `nodeid-prefix | reason` a line)."""

import pathlib
import sys
import xml.etree.ElementTree as ET


def main(junit_xml: str) -> int:
    allow_file = pathlib.Path(__file__).with_name("allowed_skips.txt")
    allowed = []
    for line in allow_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            prefix, _, reason = line.partition("|")
            if not reason.strip():
                print(f"{allow_file}: every allowed skip needs a reason: {line!r}", file=sys.stderr)
                return 1
            allowed.append(prefix.strip())
    bad = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            continue
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        path = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        if not any(nodeid.startswith(p) or path.startswith(p) for p in allowed):
            bad.append(f"  {path}: {skip.get('message', '')}")
    if bad:
        print("CI: tests skipped without an entry in .ci/allowed_skips.txt:", file=sys.stderr)
        print("\n".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
