"""Train several head methods for one target from one shared feature cache (the target runs once).

    python scripts/train_heads.py --data DIR --methods eagle3 medusa:600 mtp --steps 300
(METHOD:STEPS overrides --steps for that method.)
Writes checkpoints/<model-name>-<method>/ (or under --out-root) with a train_log.json beside the heads.
"""
import argparse
import json
import time
from pathlib import Path

import spec_jax
from spec_jax.train.distill import load_distill
from spec_jax.train.loop import TrainConfig, feature_cache, train

LR = {"eagle": 2e-3, "eagle3": 2e-3, "medusa": 2e-3, "mtp": 2e-3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--data", required=True)
    ap.add_argument("--methods", nargs="+", default=["eagle3", "medusa", "mtp"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out-root", help="write <out-root>/<model-name>-<method> (default: beside the model)")
    a = ap.parse_args()
    target = spec_jax.load_target(a.model)
    seqs, plens, manifest = load_distill(a.data)
    t0 = time.time()
    aux_layers = target.cfg.eagle3_layers if any(m.startswith("eagle3") for m in a.methods) else ()
    toks, mask, feats, aux = feature_cache(target, seqs, plens, a.seq_len, aux_layers)
    print(f"feature cache: {len(toks)} x {a.seq_len} tokens in {time.time() - t0:.0f}s", flush=True)
    for spec in a.methods:
        m, _, steps = spec.partition(":")
        data = {"tokens": toks, "mask": mask, "feats": feats, "aux": aux if m == "eagle3" else None}
        cfg = TrainConfig(method=m, steps=int(steps or a.steps), batch_size=a.batch_size,
                          seq_len=a.seq_len, lr=LR[m], draft_vocab=a.draft_vocab)
        out = Path(a.out_root or Path(a.model).parent) / f"{Path(a.model).name}-{m}"
        heads, hist = train(target, data, cfg, out_dir=out, ckpt_dir=Path("/tmp") / f"ckpt-{m}",
                            resume=a.resume)
        (out / "train_log.json").write_text(json.dumps({"manifest": manifest, "history": hist},
                                                       indent=1))
        print(f"{m}: {hist[-1]} -> {out}", flush=True)


if __name__ == "__main__":
    main()
