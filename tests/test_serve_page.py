"""`minigpt serve`'s page script run by Node against a stub DOM: what it draws from a run's metrics, checked
without a browser (tests/test_serve_browser.py drives the whole page in Chromium where it is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
from conftest import ROOT

NODE = shutil.which("node")
APP = ROOT / "minigpt" / "serve" / "static" / "app.js"
FIXTURE_METRICS = ROOT / "tests" / "fixtures" / "run-v0.1-char" / "metrics.jsonl"

# just enough of a browser for app.js to load (its requests never answer) and for drawCurve to draw into
STUB_DOM = r"""
const fs = require("fs"), vm = require("vm");
class Element {
  constructor(tag) { Object.assign(this, { tag, attributes: {}, children: [], textContent: "", value: "" }); }
  setAttribute(k, v) { this.attributes[k] = String(v); }
  replaceChildren(...children) { this.children = children; }
  append(...children) { this.children.push(...children); }
  addEventListener() {}
}
const byId = {};
const document = {
  getElementById: (id) => (byId[id] ??= new Element("div")),
  createElementNS: (ns, tag) => new Element(tag),
  createElement: (tag) => new Element(tag),
};
const page = { document, console, localStorage: { getItem: () => null, setItem() {} }, fetch: () => new Promise(() => {}) };
vm.createContext(page);
vm.runInContext(fs.readFileSync(process.argv[1], "utf8"), page);
page.metrics = JSON.parse(fs.readFileSync(0, "utf8"));
vm.runInContext("drawCurve(metrics)", page);
console.log(JSON.stringify(byId.curve.children.map((c) => ({ tag: c.tag, ...c.attributes }))));
"""


def drawn(metrics: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """What the loss chart draws, SVG tag and attributes by class: the x axis (drawn first of the two
    axes), the train and the validation series."""
    result = subprocess.run(
        [NODE, "-e", STUB_DOM, str(APP)],
        input=json.dumps(metrics),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    shapes: dict[str, dict[str, str]] = {}
    for shape in json.loads(result.stdout):
        shapes.setdefault(shape.get("class", ""), shape)
    return shapes


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_a_series_of_one_point_is_drawn_as_a_dot() -> None:
    records = [json.loads(line) for line in FIXTURE_METRICS.read_text().splitlines()]
    trains, evals = ([r for r in records if r["kind"] == kind] for kind in ("train", "eval"))
    assert len(evals) == 2
    both = drawn(records)
    assert both["train"]["tag"] == both["val"]["tag"] == "polyline"
    assert len(both["val"]["points"].split()) == 2
    # a run evaluated once, as one stopped before its second evaluation is
    once = drawn([*trains, evals[-1]])
    assert once["train"]["tag"] == "polyline" and once["val"]["tag"] == "circle"
    # at the last train step, where it was taken, and on the x axis: its loss is the chart's lowest
    assert evals[-1]["step"] == trains[-1]["step"] and evals[-1]["val_loss"] < min(r["loss"] for r in trains)
    last_train_x = once["train"]["points"].split()[-1].split(",")[0]
    assert (once["val"]["cx"], once["val"]["cy"]) == (last_train_x, once["axis"]["y1"])
    # a run of one step: two dots
    first = drawn([records[0], {**evals[0], "step": records[0]["step"]}])
    assert first["train"]["tag"] == first["val"]["tag"] == "circle"
