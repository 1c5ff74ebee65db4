"""docs/quickstart.ipynb runs top to bottom (from docs/, as Jupyter runs it) and shows what it
promises: lossless EAGLE decoding, a stream equal to generate, an HTML view, a plot. The committed
outputs are those of `scripts/run_notebook.py`; this test writes nothing."""
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm2

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebook", ROOT / "scripts" / "run_notebook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_notebook_executes_and_shows_html_and_a_plot(smollm2):
    nbformat = pytest.importorskip("nbformat")
    run = _runner()
    committed = nbformat.read(run.NOTEBOOK, as_version=4)
    # the committed notebook is the one its script builds (cells edited there, not by hand)
    assert [c.source for c in committed.cells] == [c.source for c in run.build().cells]
    nb = run.execute(committed)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    kinds = {k for o in outputs for k in o.get("data", {})}
    assert "same text as generate: True" in text
    assert "speed-up" in text
    assert {"text/html", "image/png"} <= kinds
    assert not [o for o in outputs if o.output_type == "error"]
