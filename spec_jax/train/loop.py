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
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_jax.errors import SpecJaxError
from spec_jax.features import feature_cache, token_arrays  # noqa: F401 (token_arrays: scripts)
from spec_jax.heads.methods import METHODS, method_of
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


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Indices of the batch at `step`: epochs are seeded permutations (deterministic, resumable)."""
    per_epoch = max(n // batch, 1)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


def make_loss(heads: DraftHeads, tcfg, cfg: TrainConfig):
    """loss(dparams, tparams, batch, key) -> (loss, metrics) for these heads under `cfg`: a feature
    drafter's unrolled loss with its method's settings (`Method.unroll`), or the per-head
    cross-entropy of heads that read every depth off one feature (`Method.head_logits`)."""
    method = method_of(heads.method)
    if cfg.labels not in ("hard", "soft"):
        raise SpecJaxError(f"labels={cfg.labels!r}: use 'hard' or 'soft'")
    if method.unroll is None:
        if cfg.labels == "soft":
            feature = ", ".join(m.name for m in METHODS.values() if m.unroll is not None)
            raise SpecJaxError(f"soft labels are for feature drafters ({feature}); "
                               f"train {method.title} with labels='hard'")
        n = method.profile_depth(heads.hparams)
        return lambda dp, tp, batch, key: losses.heads_loss(method.head_logits, dp, tp, tcfg, batch,
                                                            n, cfg.decay)
    drafter = heads.drafter()
    kw = method.unroll(heads.hparams, cfg)
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
        heads.params, heads.hparams = method_of(cfg.method).grow(
            heads.params, heads.hparams, target, dict(cfg.hparams), cfg.seed)
    else:
        extra = dict(cfg.hparams)
        v = target.cfg.vocab_size
        size = extra.get("draft_vocab", cfg.draft_vocab) or v
        if method_of(cfg.method).own_vocab or size < v:  # an own LM head: always a draft vocabulary
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
    run.update(method_of(heads.method).train_record(heads.hparams, cfg))
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
    with LM heads of their own (`Method.flag_hparams`)."""
    return method_of(method).flag_hparams(layers, features, own_lm_heads)


def train_cli(a):
    """`spec-jax train`: distilled data -> feature cache -> training -> heads in --out."""
    import spec_jax
    from spec_jax.data import load_sets

    method = method_of(a.method)
    wrong = [flag for flag, used in (("--own-lm-heads", a.own_lm_heads), ("--layers", a.layers != 1),
                                     ("--eagle-features", a.eagle_features))
             if used and flag not in method.flags]
    if wrong:
        raise SpecJaxError(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to "
                           f"--method {a.method} (--own-lm-heads is for medusa, --layers and "
                           "--eagle-features for eagle): leave them out")
    target = spec_jax.load_target(a.model)
    out = Path(a.out)
    if out.exists() and (out / "spec_jax.json").exists() and not (a.resume or a.force):
        raise SpecJaxError(f"{out} already holds heads: pass --force to retrain or --resume")
    seqs, plens, manifest = load_sets(a.data, target)
    aux_layers = method.aux_layers(target.cfg)
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
