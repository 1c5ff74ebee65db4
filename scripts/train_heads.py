"""Train several head methods for one target from one shared feature cache (the target runs once).

    python scripts/train_heads.py --data DIR --methods eagle3 medusa:600 mtp --steps 300
(METHOD:STEPS overrides --steps for that method.)
Writes checkpoints/<model-name>-<method>/ (or under --out-root) with a train_log.json beside the heads;
Orbax checkpoints for --resume go to <that folder>.ckpt/. --features DIR keeps the target's
features of each data set on disk (DIR/<set>-<samples>/), so a second run (another method, more
steps, another set added) skips the target pass over the sets it has seen. Several --data sets
are concatenated; the end of the last is held out. --init fine-tunes existing heads.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

import spec_jax
from spec_jax.errors import SpecJaxError
from spec_jax.train.distill import check_source, load_distill
from spec_jax.train.loop import TrainConfig, feature_cache, head_hparams, train

LR = {"eagle": 2e-3, "eagle3": 2e-3, "medusa": 2e-3, "mtp": 2e-3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--data", required=True, nargs="+",
                    help="distilled sets, concatenated (the end of the last is held out)")
    ap.add_argument("--methods", nargs="+", default=["eagle3", "medusa", "mtp"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, help="peak learning rate (default: 2e-3 for every method)")
    ap.add_argument("--eagle-ttt", type=int, default=1,
                    help="EAGLE-1/2 draft steps unrolled in training (1: the paper's recipe)")
    ap.add_argument("--labels", choices=("hard", "soft"), default="hard",
                    help="cross-entropy on the data's tokens, or on the target's distribution (EAGLE's loss)")
    ap.add_argument("--eagle-ce-weight", type=float, default=0.1,
                    help="EAGLE-1/2: cross-entropy weight beside the feature loss (the paper's 0.1)")
    ap.add_argument("--eagle-layers", type=int, default=1,
                    help="EAGLE-1/2 decoder layers (1: the paper's head); --init heads with fewer "
                         "are grown by identity layers (see spec_jax.train.loop.train)")
    ap.add_argument("--eagle-features", choices=("pre", "post"),
                    help="EAGLE-1/2 features: the target's final hidden states after its final "
                         "norm (the reference's; default for fresh heads), or before it; --init "
                         "heads keep their own")
    ap.add_argument("--medusa-lm-heads", action="store_true",
                    help="Medusa: an LM head of its own per head (Medusa-1's; --init heads without "
                         "them start from copies of the target's)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out-root", help="write <out-root>/<model-name>-<method> (default: beside the model)")
    ap.add_argument("--features", help="folder to keep (or reuse) the target's features in")
    ap.add_argument("--init", nargs="*", default=[],
                    help="heads folders to fine-tune from (one per method; kept unchanged)")
    a = ap.parse_args()
    methods = [(m, int(st or a.steps)) for m, _, st in (x.partition(":") for x in a.methods)]
    outs = {m: Path(a.out_root or Path(a.model).parent) / f"{Path(a.model).name}-{m}" for m, _ in methods}
    ckpts = {m: out.with_name(out.name + ".ckpt") for m, out in outs.items()}
    for ckpt in ckpts.values():  # train() checks this too, but only after the feature pass
        if not a.resume and ckpt.is_dir() and any(ckpt.iterdir()):
            raise SpecJaxError(f"{ckpt} already holds checkpoints: pass --resume, or remove it")
    target = spec_jax.load_target(a.model)
    inits = {h.method: h for h in map(spec_jax.load_draft, a.init)}
    sets = [load_distill(d) for d in a.data]
    for d, (_, _, m) in zip(a.data, sets):  # every set is checked before the first target pass
        check_source(d, m, target)
    t0 = time.time()
    aux_layers = target.cfg.eagle3_layers if any(m == "eagle3" for m, _ in methods) else ()
    parts = [_features(target, d, seqs, plens, a.seq_len, aux_layers, a.features)
             for d, (seqs, plens, _) in zip(a.data, sets)]
    manifest = [m for _, _, m in sets]
    # one set stays memory-mapped (EAGLE-3's fused features of 3 072 samples are 5.4 GB)
    toks, mask, feats, aux = (None if parts[0][k] is None else parts[0][k] if len(parts) == 1
                              else np.concatenate([p[k] for p in parts]) for k in range(4))
    print(f"feature cache: {len(toks)} x {a.seq_len} tokens in {time.time() - t0:.0f}s", flush=True)
    for m, steps in methods:
        data = {"tokens": toks, "mask": mask, "feats": feats, "aux": aux if m == "eagle3" else None}
        cfg = TrainConfig(method=m, steps=steps, batch_size=a.batch_size,
                          seq_len=a.seq_len, lr=a.lr or LR[m], draft_vocab=a.draft_vocab,
                          eagle_ttt_steps=a.eagle_ttt, eagle_ce_weight=a.eagle_ce_weight,
                          labels=a.labels if m != "medusa" else "hard",
                          hparams=head_hparams(m, a.eagle_layers, a.eagle_features,
                                               a.medusa_lm_heads))
        out = outs[m]
        heads, hist = train(target, data, cfg, out_dir=out, ckpt_dir=ckpts[m],
                            resume=a.resume, init=inits.get(m))
        (out / "train_log.json").write_text(json.dumps({"manifest": manifest, "history": hist},
                                                       indent=1))
        print(f"{m}: {hist[-1]} -> {out}", flush=True)


def _features(target, data_dir, seqs, plens, seq_len, aux_layers, folder):
    """feature_cache of one distilled set, kept under `folder` (one numpy folder per set) when
    given, and reused when it matches (a folder with the fused EAGLE-3 features also serves
    methods that need none)."""
    names = ("tokens", "mask", "feats", "aux")
    if folder:
        f = Path(folder) / f"{Path(data_dir).resolve().name}-{len(seqs)}"
        meta = {"target": target.fingerprint(), "n": len(seqs), "seq_len": seq_len,
                "aux_layers": list(aux_layers)}
        if (f / "meta.json").is_file():
            have = json.loads((f / "meta.json").read_text())
            if have == meta or (not aux_layers and have == {**meta, "aux_layers": have["aux_layers"]}):
                return tuple(np.load(f / f"{n}.npy", mmap_mode="r")
                             if (n != "aux" or aux_layers) and (f / f"{n}.npy").is_file()
                             else None for n in names)
    arrays = feature_cache(target, seqs, plens, seq_len, aux_layers, progress=True)
    if folder:
        f.mkdir(parents=True, exist_ok=True)
        for n, x in zip(names, arrays):
            if x is not None:
                np.save(f / f"{n}.npy", x)
        (f / "meta.json").write_text(json.dumps(meta))  # written last: marks the folder complete
    return arrays


if __name__ == "__main__":
    main()
