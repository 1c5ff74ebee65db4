"""The shipped SmolLM2-135M-Instruct heads (EAGLE with a draft vocabulary, EAGLE-3, Medusa over the
target's LM head with a draft vocabulary) exported in their published layouts and imported back:
the same parameters, bit for bit, and the same first draft step along an MT-bench prompt.
scripts/heads_roundtrip.py compares their decoding (tau and tokens) on MT-bench prompts."""
import json

import jax
import numpy as np
import pytest

import spec_jax
from spec_jax.data import prompt_set
from tests.conftest import ROOT

pytestmark = pytest.mark.smollm2

FILES = {"eagle": "model.safetensors", "eagle3": "model.safetensors",
         "medusa": "medusa_lm_head.safetensors"}


def _flat(heads) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(a)
            for k, a in jax.tree_util.tree_leaves_with_path(heads.params)}


@pytest.mark.parametrize("method", list(FILES))
def test_shipped_heads_export_and_import_bit_for_bit(smollm2, tmp_path, method):
    heads = spec_jax.load_draft(ROOT / "checkpoints" / f"smollm2-135m-instruct-{method}")
    out = spec_jax.export_heads(method, heads, tmp_path / method, target=smollm2)
    assert (out / FILES[method]).is_file()
    back = spec_jax.import_heads(method, out, smollm2)
    a, b = _flat(heads), _flat(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    text = json.loads(prompt_set("mt_bench").read_text().splitlines()[0])["turns"][0]
    ids = smollm2.encode(text)
    want = spec_jax.draft_logits(smollm2, heads, ids)
    assert np.isfinite(want).any(axis=1).all()
    np.testing.assert_array_equal(spec_jax.draft_logits(smollm2, back, ids), want)
