"""Print the requirements of meshfit's pyproject.toml, one a line: its dependencies and those of
the extras named (comma-separated), an extra's meshfit[...] expanded, e.g.

    python tools/requirements.py cpu,test-core

`make test` installs both version sets' requirements side by side with these, then meshfit itself
into each, one after the other (see the Makefile).
"""

import os
import re
import sys
import tomllib


def requirements(extras: list[str], project: dict) -> list[str]:
    """The dependencies and those of `extras`, meshfit's own extras expanded, each once."""
    found = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            own = re.fullmatch(rf"{project['name']}\[(.+)\]", line.replace(" ", ""))
            if own:
                todo += own.group(1).split(",")
            else:
                found.append(line)
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    print("\n".join(requirements(sys.argv[1].split(",") if len(sys.argv) > 1 else [], project)))
