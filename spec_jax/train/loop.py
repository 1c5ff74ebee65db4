"""Train draft heads with optax on self-distillation data; checkpoint and resume with Orbax.

Only head parameters are trained: the target (its embedding and LM head included) stays frozen.
The target's hidden states are computed once for the whole data set and cached in memory (see
`feature_cache`): on this CPU that costs one target pass per sequence, where computing them inside
every training step would cost one per step and epoch.

Data order is a pure function of (seed, step), so a run resumed from a checkpoint sees exactly the
batches an uninterrupted run would, and ends with the same parameters. The last `holdout` share of
the sequences is never trained on: every `eval_every` steps and at the end, the per-depth top-1
accuracy of the heads on it (teacher-forced, no input noise) goes into the history as `eval_acc*`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_jax.errors import SpecJaxError
from spec_jax.heads.eagle import features_of
from spec_jax.heads.registry import DraftHeads, init_draft, save_draft
from spec_jax.heads.vocab import DERIVED, frequent_tokens
from spec_jax.train import losses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    method: str
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 0.5
    seed: int = 0
    ttt_steps: int = 3  # unrolled draft steps (EAGLE-3)
    # EAGLE-1/2 draft steps unrolled in training: 1 is the paper's recipe; more adds EAGLE-3's
    # training-time test (later steps feed back the head's own features, cross-entropy only)
    eagle_ttt_steps: int = 1
    noise: float = 0.1  # uniform feature noise (EAGLE-1/2)
    # EAGLE-1/2: weight of the cross-entropy beside the SmoothL1 feature loss (the paper's 0.1, set
    # for LLaMA's hidden states; SmolLM2's are ~25 per dimension, so its feature loss outweighs it)
    eagle_ce_weight: float = 0.1
    decay: float = 0.8
    save_every: int = 200
    keep: int = 2
    holdout: float = 0.05  # share of sequences held out for evaluation (none below 20 sequences)
    eval_every: int = 100
    draft_vocab: int = 8192  # propose from the most frequent response tokens (0: full vocabulary)
    # "hard": cross-entropy on the data's next tokens; "soft": on the target's distribution there
    # (EAGLE's and EAGLE-3's loss; feature drafters only)
    labels: str = "hard"
    hparams: tuple = ()  # extra head hyper-parameters as (key, value) pairs


NON_TRAINABLE = ("d2t", "t2d") + DERIVED


def split_params(params):
    train = {k: v for k, v in params.items() if k not in NON_TRAINABLE}
    frozen = {k: v for k, v in params.items() if k in NON_TRAINABLE}
    return train, frozen


def token_arrays(seqs, plens, seq_len):
    """Sequences truncated and zero-padded to seq_len: tokens [N, L] and mask [N, L], 1 from the
    last prompt token on (the positions whose next token is a response token)."""
    n = len(seqs)
    toks = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        s = s[:seq_len]
        toks[i, :len(s)] = s
        mask[i, max(p - 1, 0):len(s)] = 1.0
    return toks, mask


def feature_cache(target, seqs, plens, seq_len, aux_layers=(), batch=8, chunk="auto",
                  progress=False):
    """Run the frozen target once over every sequence (truncated to seq_len); `progress` shows a
    bar over sequences (the pass takes ~1 s a sequence on a 2-core CPU).

    Returns tokens [N, L], mask [N, L] (see token_arrays), feats [N, L, H], aux or None.
    chunk: run each batch `chunk` tokens at a time against a KV cache (a chunked prefill) instead
    of all at once. "auto" picks 64 // batch for targets in the packed CPU layout (as fast as one
    pass now that the packed kernel takes any row count: 12.6-13.3 s for 32 sequences of 256
    tokens either way, in less activation memory), and None (one pass) otherwise."""
    toks, mask = token_arrays(seqs, plens, seq_len)
    n = len(seqs)
    cfg = target.cfg
    if chunk == "auto":
        chunk = max(64 // batch, 1) if target.layout == "packed" else None
    fwd = jax.jit(functools.partial(_target_features, target=target, aux_layers=aux_layers,
                                    chunk=chunk))
    feats = np.zeros((n, seq_len, cfg.hidden_size), np.float32)
    aux = np.zeros((n, seq_len, cfg.hidden_size * len(aux_layers)), np.float32) if aux_layers else None
    # batches of similar length, each cut to its longest sequence (rounded up to 64 tokens: few
    # shapes to compile); causal attention makes a position's features independent of the cut
    lengths = np.minimum([len(x) for x in seqs], seq_len)
    order = np.argsort(lengths, kind="stable")
    from tqdm import tqdm
    bar = tqdm(total=n, disable=not progress, desc="target features", unit="seq")
    for i in range(0, n, batch):
        idx = order[i:i + batch]
        cut = min(seq_len, -(-int(lengths[idx].max()) // 64) * 64)
        part = np.pad(toks[idx, :cut], ((0, batch - len(idx)), (0, 0)))
        hidden, aux_hidden = fwd(target.params, jnp.asarray(part))
        feats[idx, :cut] = np.asarray(hidden[:len(idx)], np.float32)
        if aux is not None:
            aux[idx, :cut] = np.asarray(aux_hidden[:len(idx)], np.float32)
        bar.update(len(idx))
    bar.close()
    return toks, mask, feats, aux


def _target_features(params, tokens, *, target, aux_layers, chunk):
    """tokens [B, L] -> (hidden [B, L, H], aux [B, L, H * len(aux_layers)] or None)."""
    from spec_jax.cache import cache_for, commit
    from spec_jax.models.llama import causal_mask, forward

    cfg = target.cfg
    b, length = tokens.shape
    if chunk is None or chunk >= length:
        out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32),
                      tokens.shape), cache_for(cfg, b, 1), causal_mask(b, length),
                      aux_layers=aux_layers, return_logits=False)
        return out.hidden, out.aux_hidden
    steps = -(-length // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, steps * chunk - length)))
    arange = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))

    def body(cache, i):
        pos = i * chunk + arange
        out = forward(params, cfg, jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1),
                      pos, cache, causal_mask(b, chunk), aux_layers=aux_layers,
                      return_logits=False, attn_impl="auto")
        # commit after every layer's cache read (see step.py), so the cache is updated in place
        k, v, hidden, aux = jax.lax.optimization_barrier(
            (out.k_new, out.v_new, out.hidden, out.aux_hidden))
        cache = commit(cache, k, v, pos, arange, jnp.full((b,), chunk, jnp.int32))
        return cache, (hidden, aux)

    _, (hidden, aux) = jax.lax.scan(body, target.new_cache(b, steps * chunk), jnp.arange(steps))
    join = lambda x: None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, steps * chunk, -1)[:, :length]
    return join(hidden), join(aux)


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Indices of the batch at `step`: epochs are seeded permutations (deterministic, resumable)."""
    per_epoch = max(n // batch, 1)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


def unrolled_steps(heads: DraftHeads, cfg: TrainConfig) -> int:
    """Draft steps a feature drafter is unrolled for in training (EAGLE, EAGLE-3, MTP)."""
    if heads.method == "eagle":
        return cfg.eagle_ttt_steps
    if heads.method == "eagle3":
        return cfg.ttt_steps
    return heads.hparams.get("depth", 3)


def make_loss(heads: DraftHeads, tcfg, cfg: TrainConfig):
    method = heads.method
    if cfg.labels not in ("hard", "soft"):
        raise SpecJaxError(f"labels={cfg.labels!r}: use 'hard' or 'soft'")
    if method == "medusa":
        if cfg.labels == "soft":
            raise SpecJaxError("soft labels are for feature drafters (eagle, eagle3, mtp); "
                               "train Medusa with labels='hard'")
        n = heads.hparams["num_heads"]
        return lambda dp, tp, batch, key: losses.medusa_loss(dp, tp, tcfg, batch, n, cfg.decay)
    drafter = heads.drafter()
    steps = unrolled_steps(heads, cfg)
    if method == "eagle":
        kw = dict(steps=steps, noise=cfg.noise, feat_loss_weight=1.0,
                  ce_weight=cfg.eagle_ce_weight, decay=cfg.decay)
    else:  # eagle3 and mtp: unrolled, cross-entropy only
        kw = dict(steps=steps, noise=0.0, feat_loss_weight=0.0, ce_weight=1.0,
                  decay=cfg.decay if method == "eagle3" else 1.0)
    return lambda dp, tp, batch, key: losses.feature_unrolled(drafter, dp, tp, tcfg, batch, key=key,
                                                              soft=cfg.labels == "soft", **kw)


def train(target, data: dict, cfg: TrainConfig, out_dir=None, ckpt_dir=None, resume=False,
          progress=True, stop_after: int | None = None, log=print, init: DraftHeads | None = None):
    """Train heads of cfg.method on `data` (from `feature_cache`). Returns (DraftHeads, history).

    init: heads to start from (fine-tuning on new data) instead of random ones; their
    hyper-parameters and draft vocabulary are kept, except that an EAGLE head is grown by identity
    layers when cfg.hparams asks for more `num_layers` (spec_jax.heads.eagle.add_layers), and
    Medusa heads get LM heads of their own for `own_lm_heads` (spec_jax.heads.medusa.add_lm_heads)."""
    import orbax.checkpoint as ocp

    if init is not None:
        if init.method != cfg.method:
            raise SpecJaxError(f"--init heads are {init.method}, not {cfg.method}: start from heads "
                               "of the method being trained")
        init.check_target(target)
        heads = DraftHeads(init.method, dict(init.params), dict(init.hparams), init.target_info)
        layers = dict(cfg.hparams).get("num_layers", 1)
        have = features_of(heads.hparams)
        want = dict(cfg.hparams).get("features", have)
        if cfg.method == "eagle" and want != have:
            raise SpecJaxError(f"--init heads read {have}-norm features, not {want}-norm: train a "
                               f"fresh head for {want}")
        if cfg.method == "eagle" and layers > heads.hparams.get("num_layers", 1):
            from spec_jax.heads.eagle import add_layers

            heads.params = add_layers(heads.params, target.cfg, layers,
                                      jax.random.PRNGKey(cfg.seed))
            heads.hparams["num_layers"] = layers
        if cfg.method == "medusa" and dict(cfg.hparams).get("own_lm_heads") and \
                "lm_heads" not in heads.params:
            from spec_jax.heads.medusa import add_lm_heads

            heads.params = add_lm_heads(heads.params, target.params, target.cfg)
            heads.hparams["own_lm_heads"] = True
    else:
        extra = dict(cfg.hparams)
        v = target.cfg.vocab_size
        size = extra.get("draft_vocab", cfg.draft_vocab) or v
        if cfg.method == "eagle3" or size < v:  # EAGLE-3's own LM head always has a draft vocabulary
            vocab = frequent_tokens(data["tokens"], data["mask"], min(size, v), v)
            extra.update(draft_vocab=len(vocab), d2t=vocab)
        heads = init_draft(target, cfg.method, seed=cfg.seed, **extra)
    heads.params = heads.bind(target, pack=False)
    trainable, frozen = split_params(heads.params)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1),
                                               cfg.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip),
                      optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    opt_state = opt.init(trainable)
    loss_fn = make_loss(heads, target.cfg, cfg)
    eval_loss = make_loss(heads, target.cfg, dataclasses.replace(cfg, noise=0.0))

    @jax.jit
    def eval_fn(trainable, batch):
        return eval_loss({**trainable, **frozen}, target.params, batch, jax.random.PRNGKey(0))[1]

    @jax.jit
    def step_fn(trainable, opt_state, batch, key):
        def f(tr):
            return loss_fn({**tr, **frozen}, target.params, batch, key)

        (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, metrics

    start = 0
    mngr = None
    if ckpt_dir is not None:
        mngr = ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, save_interval_steps=1))
        if resume and mngr.latest_step() is not None:
            start = mngr.latest_step()
            restored = mngr.restore(start, args=ocp.args.StandardRestore(
                {"params": trainable, "opt_state": opt_state}))
            trainable, opt_state = restored["params"], restored["opt_state"]
            log(f"resumed from step {start}")
        elif not resume and mngr.latest_step() is not None:
            raise SpecJaxError(f"{ckpt_dir} already holds checkpoints: pass --resume to continue, "
                               "or choose another --out")
    total = len(data["tokens"])
    n_eval = max(1, int(total * cfg.holdout)) if total >= 20 and cfg.holdout > 0 else 0
    n = total - n_eval  # the last n_eval sequences are held out

    def evaluate(trainable):
        """Teacher-forced top-1 accuracy per draft depth on the held-out sequences."""
        sums, count = {}, 0
        for i in range(n, total, cfg.batch_size):
            idx = np.arange(i, min(i + cfg.batch_size, total))
            m = eval_fn(trainable, {k: jnp.asarray(v[idx]) for k, v in data.items() if v is not None})
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(idx)
            count += len(idx)
        return {f"eval_{k}": v / count for k, v in sums.items()}

    history = []
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc=f"train {cfg.method}")
    t0, toks_seen = time.time(), 0
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    for step in range(start, end):
        idx = batch_indices(n, cfg.batch_size, step, cfg.seed)
        batch = {k: jnp.asarray(v[idx]) for k, v in data.items() if v is not None}
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step)
        trainable, opt_state, metrics = step_fn(trainable, opt_state, batch, key)
        toks_seen += int(data["mask"][idx].sum())
        do_eval = n_eval and ((step + 1) % cfg.eval_every == 0 or step == end - 1)
        if step % 10 == 0 or step == end - 1 or do_eval:
            m = {k: float(v) for k, v in metrics.items()}
            if do_eval:
                m.update(evaluate(trainable))
            history.append({"step": step + 1, **m})
            post = dict(loss=f"{m['loss']:.3f}",
                        acc=",".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("acc")),
                        tok_s=f"{toks_seen / (time.time() - t0):.0f}")
            if "eval_acc1" in m:
                post["eval_acc"] = ",".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("eval_acc"))
            bar.set_postfix(**post)
        bar.update(1)
        if mngr is not None and ((step + 1) % cfg.save_every == 0 or step + 1 == end):
            mngr.save(step + 1, args=ocp.args.StandardSave({"params": trainable, "opt_state": opt_state}))
    bar.close()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    heads.params = {**trainable, **frozen}
    run = {"steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "lr": cfg.lr,
           "seed": cfg.seed, "labels": cfg.labels, "wall_seconds": round(time.time() - t0, 1)}
    if heads.method in ("eagle", "eagle3"):
        run["ttt_steps"] = unrolled_steps(heads, cfg)
    if heads.method == "eagle":
        run["ce_weight"] = cfg.eagle_ce_weight
    if init is not None:  # keep the record of the runs it was fine-tuned from
        run["init"] = init.hparams.get("training")
    heads.hparams["training"] = run
    if out_dir is not None and end == cfg.steps:
        save_draft(heads, out_dir, force=True)
    return heads, history


def head_hparams(method: str, layers: int = 1, features: str | None = None,
                 own_lm_heads: bool = False) -> tuple:
    """TrainConfig.hparams from the CLI's options: an EAGLE head's `layers` decoder layers and
    `features` "pre" or "post" (None: an --init head's own, "post" for a fresh one); Medusa heads
    with LM heads of their own."""
    if method == "eagle":
        return (("num_layers", layers),) + ((("features", features),) if features else ())
    if method == "medusa" and own_lm_heads:
        return (("own_lm_heads", True),)
    return ()


def train_cli(a):
    """`spec-jax train`: distilled data -> feature cache -> training -> heads in --out."""
    import spec_jax
    from spec_jax.train.distill import load_sets

    wrong = [flag for flag, used, method in (("--own-lm-heads", a.own_lm_heads, "medusa"),
                                             ("--layers", a.layers != 1, "eagle"),
                                             ("--eagle-features", a.eagle_features, "eagle"))
             if used and a.method != method]
    if wrong:
        raise SpecJaxError(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to "
                           f"--method {a.method} (--own-lm-heads is for medusa, --layers and "
                           "--eagle-features for eagle): leave them out")
    target = spec_jax.load_target(a.model)
    out = Path(a.out)
    if out.exists() and (out / "spec_jax.json").exists() and not (a.resume or a.force):
        raise SpecJaxError(f"{out} already holds heads: pass --force to retrain or --resume")
    seqs, plens, manifest = load_sets(a.data, target)
    aux_layers = target.cfg.eagle3_layers if a.method == "eagle3" else ()
    t0 = time.time()
    toks, mask, feats, aux = feature_cache(target, seqs, plens, a.seq_len, aux_layers, progress=True)
    print(f"feature cache: {len(toks)} sequences x {a.seq_len} tokens in {time.time() - t0:.1f}s")
    cfg = TrainConfig(method=a.method, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len,
                      lr=a.lr, seed=a.seed, draft_vocab=a.draft_vocab,
                      labels=a.labels, hparams=head_hparams(a.method, a.layers, a.eagle_features,
                                                            a.own_lm_heads))
    init = spec_jax.load_draft(a.init) if a.init else None
    heads, hist = train(target, {"tokens": toks, "mask": mask, "feats": feats, "aux": aux}, cfg,
                        out_dir=out, ckpt_dir=out.parent / f".{out.name}.ckpt", resume=a.resume,
                        init=init)
    (out / "train_log.json").write_text(json.dumps({"manifest": manifest, "history": hist}, indent=1))
    print(f"wrote {out}")
