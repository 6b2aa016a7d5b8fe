"""The C++ core is layered, each layer a static library linked one way only (CMakeLists.txt):
common <- kernels <- memory <- runtime <- python (the bindings). A header of a higher layer included
from a lower one would compile (one include root) but turn the layers into a knot, so this test
holds every ``#include "..."`` to that order."""

from __future__ import annotations

import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
ORDER = ["common", "kernels", "memory", "runtime", "python"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"', re.MULTILINE)


def _project_includes() -> list[tuple[str, str, str]]:
    """(file relative to csrc, its layer, the layer of a header it includes)."""
    found = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in {".hpp", ".cpp", ".cuh", ".cu"}:
            continue
        layer = path.relative_to(CSRC).parts[0]
        for included_layer in INCLUDE.findall(path.read_text()):
            found.append((str(path.relative_to(CSRC)), layer, included_layer))
    return found


def test_every_source_lives_in_a_known_layer():
    layers = {path.relative_to(CSRC).parts[0] for path in CSRC.rglob("*") if path.is_file()}
    assert layers <= set(ORDER), f"unknown csrc folders: {sorted(layers - set(ORDER))}"


def test_includes_only_go_down_the_layers():
    includes = _project_includes()
    assert includes, "no project include found: the scan is broken"
    upward = [
        f"{source} ({layer}) includes a {included} header"
        for source, layer, included in includes
        if included not in ORDER or ORDER.index(included) > ORDER.index(layer)
    ]
    assert not upward, "includes against the layer order:\n" + "\n".join(upward)
