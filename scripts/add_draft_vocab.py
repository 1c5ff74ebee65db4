"""Give trained heads that read through the target's LM head (EAGLE-1/2, Medusa, MTP) a draft
vocabulary: the N most frequent response tokens of their training data (see spec_jax.heads.vocab).
No retraining: only what the head may propose changes, never what the target accepts.

    python scripts/add_draft_vocab.py HEADS_DIR --data DISTILL_DIR [--size 8192]
"""
import argparse
from pathlib import Path

import spec_jax
from spec_jax.errors import SpecJaxError
from spec_jax.heads.registry import save_draft
from spec_jax.heads.vocab import frequent_tokens, vocab_maps
from spec_jax.train.distill import load_distill
from spec_jax.train.loop import token_arrays


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("heads")
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args()
    heads = spec_jax.load_draft(a.heads)
    if heads.method == "eagle3":
        raise SpecJaxError("EAGLE-3 heads train their own draft-vocabulary LM head already")
    seqs, plens, _ = load_distill(a.data)
    v = heads.target_info["vocab_size"]
    d2t = frequent_tokens(*token_arrays(seqs, plens, a.seq_len), a.size, v)  # as training does
    heads.params.update(vocab_maps(d2t, v))
    heads.hparams["draft_vocab"] = len(d2t)
    keep = {f.name: f.read_bytes() for f in Path(a.heads).iterdir()  # e.g. train_log.json
            if f.is_file() and f.name != "spec_jax.json"}
    save_draft(heads, a.heads, force=True)
    for name, data in keep.items():
        (Path(a.heads) / name).write_bytes(data)
    print(f"{a.heads}: draft vocabulary of {len(d2t)} tokens")


if __name__ == "__main__":
    main()
