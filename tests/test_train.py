"""Head training on a tiny model: loss falls and acceptance rises for every method; an interrupted
and resumed run ends with exactly the parameters of an uninterrupted one."""
import dataclasses

import jax
import numpy as np
import pytest

import spec_jax
from spec_jax.train.loop import TrainConfig, batch_indices, feature_cache, train
from tests.conftest import tiny_config

SEQ = 48


def permutation_target(v=32, seed=0):
    """A target that the heads can learn quickly: its greedy next token is perm[current token]."""
    import jax.numpy as jnp

    target = spec_jax.random_target(tiny_config(vocab_size=v, hidden_size=v, num_layers=1), seed=seed)
    perm = np.random.default_rng(seed).permutation(v)
    p = dict(target.params)
    p["layers"] = {k: (w * 0 if k in ("wo", "w_down") else w) for k, w in p["layers"].items()}
    p["embed"] = jnp.eye(v) * 3.0 + 0.05 * jax.random.normal(jax.random.PRNGKey(seed), (v, v))
    p["lm_head"] = jnp.zeros((v, v)).at[jnp.arange(v), jnp.asarray(perm)].set(4.0)
    target.params = p
    return target


@pytest.fixture(scope="module")
def toy():
    """A toy target and a corpus of its own greedy continuations (self-distillation)."""
    target = permutation_target()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 32, 4)) for _ in range(32)]
    outs = spec_jax.generate_batch(target, prompts, SEQ - 4, stop_at_eos=False)
    seqs = [np.asarray(p + o.token_ids, np.int32) for p, o in zip(prompts, outs)]
    return target, prompts, seqs


def data_for(target, seqs, method):
    aux = target.cfg.eagle3_layers if method == "eagle3" else ()
    toks, mask, feats, aux = feature_cache(target, seqs, [4] * len(seqs), SEQ, aux)
    return {"tokens": toks, "mask": mask, "feats": feats, "aux": aux}


def mean_tau(target, prompts, heads):
    rs = spec_jax.generate_batch(target, prompts[:8], 24, draft=heads, stop_at_eos=False)
    return float(np.mean([r.stats["mean_accepted"] for r in rs]))


HP = {"eagle": {"top_k": 2, "depth": 3, "total_tokens": 6},
      "eagle3": {"top_k": 2, "depth": 3, "total_tokens": 6, "draft_vocab": 24},
      "medusa": {"num_heads": 3, "draft_vocab": 30}, "mtp": {"depth": 2, "draft_vocab": 30}}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp"])
def test_training_lowers_loss_and_raises_acceptance(toy, method):
    target, prompts, seqs = toy
    data = data_for(target, seqs, method)
    lr = 2e-2 if method == "medusa" else 3e-3  # Medusa's residual blocks start at zero
    cfg = TrainConfig(method=method, steps=200, batch_size=8, seq_len=SEQ, lr=lr, warmup=10,
                      ttt_steps=2, hparams=tuple(HP[method].items()))
    untrained = spec_jax.init_draft(target, method, seed=0, **HP[method])
    heads, hist = train(target, data, cfg, progress=False)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    assert hist[-1]["acc1"] > 0.6
    assert hist[-1]["eval_acc1"] > 0.6  # on held-out sequences the heads never saw
    tau0, tau1 = mean_tau(target, prompts, untrained), mean_tau(target, prompts, heads)
    assert tau1 > tau0 + 0.5, (tau0, tau1)


def test_kill_and_resume_gives_identical_parameters(toy, tmp_path):
    target, _, seqs = toy
    data = data_for(target, seqs, "eagle")
    cfg = TrainConfig(method="eagle", steps=12, batch_size=4, seq_len=SEQ, save_every=5,
                      hparams=tuple(HP["eagle"].items()))
    full, _ = train(target, data, cfg, ckpt_dir=tmp_path / "a", progress=False)
    train(target, data, cfg, ckpt_dir=tmp_path / "b", progress=False, stop_after=7)  # "killed" at 7
    resumed, _ = train(target, data, cfg, ckpt_dir=tmp_path / "b", resume=True, progress=False)
    for x, y in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fine_tuning_starts_from_the_given_heads(toy):
    """init= continues from trained heads: loss starts where they left off, and their
    hyper-parameters and draft vocabulary are kept."""
    target, _, seqs = toy
    data = data_for(target, seqs, "mtp")
    hp = tuple(HP["mtp"].items())
    cfg = TrainConfig(method="mtp", steps=60, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=5,
                      hparams=hp)
    first, h1 = train(target, data, cfg, progress=False)
    tuned, h2 = train(target, data, dataclasses.replace(cfg, steps=10, seed=1, hparams=()),
                      progress=False, init=first)
    assert h2[0]["loss"] < 0.6 * h1[0]["loss"]  # not a fresh start
    np.testing.assert_array_equal(np.asarray(tuned.params["d2t"]), np.asarray(first.params["d2t"]))
    assert tuned.hparams["training"]["init"]["steps"] == 60
    with pytest.raises(spec_jax.SpecJaxError, match="are mtp, not eagle"):
        train(target, data_for(target, seqs, "eagle"), dataclasses.replace(cfg, method="eagle"),
              progress=False, init=first)


def test_an_eagle_head_grown_by_a_layer_starts_where_it_was(toy):
    """init= with more num_layers grows an EAGLE head by an identity layer: the first loss is the
    one-layer head's (same batch, no noise), and the second layer then trains."""
    target, prompts, seqs = toy
    data = data_for(target, seqs, "eagle")
    cfg = TrainConfig(method="eagle", steps=40, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=5,
                      noise=0.0, hparams=tuple(HP["eagle"].items()))
    one, _ = train(target, data, cfg, progress=False)
    grow = dataclasses.replace(cfg, steps=20, hparams=(("num_layers", 2),))
    _, h_one = train(target, data, dataclasses.replace(grow, hparams=()), progress=False, init=one)
    two, h_two = train(target, data, grow, progress=False, init=one)
    assert two.hparams["num_layers"] == 2 and one.hparams["num_layers"] == 1
    assert h_two[0]["loss"] == pytest.approx(h_one[0]["loss"], rel=1e-5)
    assert float(np.abs(np.asarray(two.params["layer_1"]["w_down"])).max()) > 0
    assert h_two[-1]["loss"] < h_two[0]["loss"]
    assert mean_tau(target, prompts, two) > 3.0  # the trained head's skill survives the growth


def test_a_post_norm_eagle_head_trains_and_stays_lossless(toy, tmp_path):
    """features="post" (the reference EAGLE's): the head reads and regresses the target's final-norm
    output and feeds its own output straight to the LM head; it learns, drafts losslessly, keeps
    the setting through save and load, and a pre-norm head cannot be fine-tuned into one."""
    from spec_jax.errors import SpecJaxError
    from spec_jax.heads.registry import save_draft
    from spec_jax.models.layers import rms_norm

    target, prompts, seqs = toy
    data = data_for(target, seqs, "eagle")
    hp = {**HP["eagle"], "features": "post"}  # the default for fresh heads, spelled out
    cfg = TrainConfig(method="eagle", steps=200, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=10,
                      hparams=tuple(hp.items()))
    heads, hist = train(target, data, cfg, progress=False)
    d, tp = heads.drafter(), target.params
    assert d.features == "post"
    h = 5.0 * jax.random.normal(jax.random.PRNGKey(1), (2, 3, target.cfg.hidden_size))
    np.testing.assert_allclose(d.target_feature(heads.params, tp, target.cfg, h, None),
                               rms_norm(h, tp["final_norm"], target.cfg.rms_norm_eps), rtol=1e-5)
    # its logits are the LM head's on the feature itself (scale-equivariant), not on its norm
    lg = [d.logits(heads.params, tp, target.cfg, s * h) for s in (1.0, 3.0)]
    np.testing.assert_allclose(lg[1], 3.0 * lg[0], rtol=1e-4, atol=1e-4)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"] and hist[-1]["eval_acc1"] > 0.6
    untrained = spec_jax.init_draft(target, "eagle", seed=0, **hp)
    tau0, tau1 = mean_tau(target, prompts, untrained), mean_tau(target, prompts, heads)
    assert tau1 > tau0 + 0.5, (tau0, tau1)
    plain = spec_jax.generate_batch(target, prompts[:4], 24, stop_at_eos=False)
    spec = spec_jax.generate_batch(target, prompts[:4], 24, draft=heads, stop_at_eos=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    save_draft(heads, tmp_path / "h")
    assert spec_jax.load_draft(tmp_path / "h").drafter().features == "post"
    pre = spec_jax.init_draft(target, "eagle", seed=0, **HP["eagle"], features="pre")
    with pytest.raises(SpecJaxError, match="post-norm"):
        train(target, data, dataclasses.replace(cfg, steps=2), progress=False, init=pre)
    with pytest.raises(SpecJaxError, match="choose 'post'"):
        spec_jax.init_draft(target, "eagle", features="final")


def test_batch_order_is_a_function_of_seed_and_step():
    a = [batch_indices(20, 4, s, 0).tolist() for s in range(10)]
    assert a == [batch_indices(20, 4, s, 0).tolist() for s in range(10)]
    assert sorted(sum(a[:5], [])) == list(range(20))  # one epoch covers the data once


def _prompt_dir(tmp_path):
    import json

    d = tmp_path / "train"
    (d / "big").mkdir(parents=True)
    (d / "small").mkdir()
    (d / "big" / "a.jsonl").write_text("".join(json.dumps({"prompt": f"big {i}"}) + "\n"
                                               for i in range(30)))
    (d / "small" / "b.jsonl").write_text("".join(json.dumps({"prompt": f"small {i}"}) + "\n"
                                                 for i in range(3)))
    return d


def test_balanced_mix_takes_files_in_turn(tmp_path):
    from spec_jax.train.distill import order_prompts

    d = _prompt_dir(tmp_path)
    bal = order_prompts(d, seed=0, mix="balanced")
    assert [p.source for p in bal[:6]] == ["big", "small"] * 3  # the small file is not drowned
    assert sorted(p.text for p in bal) == sorted(p.text for p in order_prompts(d, 0, "proportional"))
    assert [p.text for p in bal] == [p.text for p in order_prompts(d, seed=0, mix="balanced")]
    assert [p.text for p in bal] != [p.text for p in order_prompts(d, seed=1, mix="balanced")]


def test_distill_refuses_eval_prompts_and_changed_settings(tmp_path):
    import json

    from spec_jax.errors import SpecJaxError
    from spec_jax.train.distill import distill

    ev = tmp_path / "eval" / "mt_bench"
    ev.mkdir(parents=True)
    (ev / "question.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
    with pytest.raises(SpecJaxError, match="evaluation prompts"):
        distill(None, tmp_path / "eval", tmp_path / "out")
    out = tmp_path / "set"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"samples": 0, "seed": 0}))  # proportional
    np.savez(out / "tokens.npz", prompt_len=np.zeros((0,), np.int32))
    prompts = _prompt_dir(tmp_path)
    with pytest.raises(SpecJaxError, match="mix 'proportional'"):
        distill(None, prompts, out, mix="balanced")
    (out / "manifest.json").write_text(json.dumps({"samples": 0, "seed": 0, "mix": "balanced",
                                                   "temperature": 0.7}))
    with pytest.raises(SpecJaxError, match="temperature 0.7"):
        distill(None, prompts, out, mix="balanced")  # greedy samples onto a sampled set


def test_eagle_training_time_test_trains_the_later_steps(toy):
    """eagle_ttt_steps > 1 unrolls EAGLE-1/2 heads in training as EAGLE-3 does: the second draft
    step, fed the head's own features, is trained and evaluated too."""
    target, _, seqs = toy
    data = data_for(target, seqs, "eagle")
    cfg = TrainConfig(method="eagle", steps=150, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=10,
                      eagle_ttt_steps=2, hparams=tuple(HP["eagle"].items()))
    heads, hist = train(target, data, cfg, progress=False)
    assert hist[0]["acc2"] < 0.3 and hist[-1]["eval_acc2"] > 0.6
    assert heads.hparams["training"]["ttt_steps"] == 2


def test_distill_stores_length_sorted_batches_in_prompt_order(tmp_path, tiny_target):
    """distill generates each window of prompts in order of length (long prompts in smaller
    batches) but stores the samples in prompt order, each as generating its prompt alone gives,
    and extending a set appends the next prompts."""
    import json

    from spec_jax.generate import generate_batch
    from spec_jax.train.distill import distill, load_distill, order_prompts

    d = tmp_path / "train" / "p"
    d.mkdir(parents=True)
    lens = [3, 150, 7, 1, 200, 12, 5, 9, 2, 40]  # 150 and 200 words pad past 128 tokens
    (d / "a.jsonl").write_text("".join(json.dumps({"prompt": " ".join(["w"] * n) + f" {i}"}) + "\n"
                                       for i, n in enumerate(lens)))

    class CharTarget(spec_jax.Target):
        def encode(self, prompt, chat=True):
            if isinstance(prompt, str):
                return [1 + ord(c) % (self.cfg.vocab_size - 1) for c in prompt]
            return super().encode(prompt, chat)

        def fingerprint(self, any_dtype=False):
            return "tiny"

    target = CharTarget(cfg=tiny_target.cfg, params=tiny_target.params)
    out = tmp_path / "set"
    distill(target, d.parent, out, num_prompts=6, max_new_tokens=5, batch_size=2, progress=False)
    distill(target, d.parent, out, num_prompts=10, max_new_tokens=5, batch_size=2, progress=False)
    seqs, plens, manifest = load_distill(out)
    assert manifest["samples"] == 10
    for p, s, n in zip(order_prompts(d.parent), seqs, plens):
        ids = target.encode(p.text)
        alone = generate_batch(target, [ids], 5, chat=False)[0].token_ids
        assert n == len(ids) and s.tolist() == ids + alone
    # a fresh set can start further along the order: the same samples, the start recorded
    later = tmp_path / "later"
    distill(target, d.parent, later, num_prompts=3, start=7, max_new_tokens=5, batch_size=2,
            progress=False)
    s7, p7, m7 = load_distill(later)
    assert m7["start"] == 7 and [s.tolist() for s in s7] == [s.tolist() for s in seqs[7:]]
    assert p7 == plens[7:]
    with pytest.raises(spec_jax.SpecJaxError, match="start 7"):
        distill(target, d.parent, later, num_prompts=4, start=0, progress=False)
    with pytest.raises(spec_jax.SpecJaxError, match="outside the 10 prompts"):
        distill(target, d.parent, tmp_path / "x", start=10, progress=False)
    # a datastore of the set holds its responses, documents separated, and says where they came from
    from spec_jax.heads.datastore import datastore_from_distill

    ds = datastore_from_distill(target, out)
    np.testing.assert_array_equal(ds.tokens, np.concatenate([np.r_[s[n:], -1] for s, n in zip(seqs, plens)]))
    assert ds.info["manifests"][0]["samples"] == 10 and ds.info["target"]["fingerprint"] == "tiny"


def test_chunked_feature_pass_matches_one_pass(tiny_target):
    """feature_cache's chunked prefill and its length-sorted, cut batches give the one-pass
    features on every real position."""
    rng = np.random.default_rng(0)
    lens = [30, 100, 70, 150, 9]
    seqs = [rng.integers(0, 64, n).astype(np.int32) for n in lens]
    plens = [3] * len(seqs)
    aux_layers = (0, 1)
    one = feature_cache(tiny_target, seqs, plens, 128, aux_layers, batch=2, chunk=None)
    chunked = feature_cache(tiny_target, seqs, plens, 128, aux_layers, batch=2, chunk=16)
    for i, n in enumerate(lens):
        n = min(n, 128)
        np.testing.assert_allclose(chunked[2][i, :n], one[2][i, :n], atol=1e-4)
        np.testing.assert_allclose(chunked[3][i, :n], one[3][i, :n], atol=1e-4)
    # ... and the features of a sequence do not depend on the others in its batch
    alone = feature_cache(tiny_target, seqs[1:2], plens[1:2], 128, aux_layers, batch=2, chunk=16)
    np.testing.assert_allclose(alone[2][0, :100], one[2][1, :100], atol=1e-4)


def test_soft_labels_are_the_targets_distribution():
    """Soft cross-entropy against a (near) one-hot target distribution is the hard cross-entropy on
    its argmax; against a flatter one it also rewards the runners-up."""
    import jax.numpy as jnp

    from spec_jax.train.losses import _ce, _soft_ce

    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 7))
    labels = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 7)
    mask = jnp.ones((2, 5)).at[1, 3:].set(0)
    sharp = 60.0 * jax.nn.one_hot(labels, 7)
    hard, acc = _ce(logits, labels, mask, {})
    soft, soft_acc = _soft_ce(logits, sharp, labels, mask, {})
    np.testing.assert_allclose(soft, hard, rtol=1e-5)
    assert soft_acc == acc
    flat, _ = _soft_ce(logits, jnp.zeros_like(logits), labels, mask, {})
    np.testing.assert_allclose(flat, -(jax.nn.log_softmax(logits).mean(-1) * mask).sum() / mask.sum(),
                               rtol=1e-5)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_soft_label_training_learns_the_target(toy, method):
    """labels='soft' (EAGLE's loss: the target's own distribution) trains heads as well as the data's
    tokens do; Medusa, which reads no target features at the next position, refuses it."""
    target, _, seqs = toy
    data = data_for(target, seqs, method)
    cfg = TrainConfig(method=method, steps=150, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=10,
                      ttt_steps=2, labels="soft", hparams=tuple(HP[method].items()))
    heads, hist = train(target, data, cfg, progress=False)
    assert hist[-1]["eval_acc1"] > 0.6
    assert heads.hparams["training"]["labels"] == "soft"
    with pytest.raises(spec_jax.SpecJaxError, match="soft labels"):
        train(target, data_for(target, seqs, "medusa"),
              dataclasses.replace(cfg, method="medusa", hparams=tuple(HP["medusa"].items())),
              progress=False)


def test_medusa_heads_given_own_lm_heads_start_where_they_were(toy, tmp_path):
    """own_lm_heads gives each Medusa head a copy of the target's LM head (over the draft
    vocabulary): fine-tuning starts at the shared heads' loss, the copies then train apart, and the
    heads save, load and decode losslessly."""
    target, prompts, seqs = toy
    data = data_for(target, seqs, "medusa")
    cfg = TrainConfig(method="medusa", steps=60, batch_size=8, seq_len=SEQ, lr=2e-2, warmup=5,
                      hparams=tuple(HP["medusa"].items()))
    shared, _ = train(target, data, cfg, progress=False)
    own_cfg = dataclasses.replace(cfg, steps=20, lr=3e-3, hparams=(("own_lm_heads", True),))
    _, h_shared = train(target, data, dataclasses.replace(own_cfg, hparams=()), progress=False,
                        init=shared)
    own, h_own = train(target, data, own_cfg, progress=False, init=shared)
    assert "lm_heads" not in shared.params and own.hparams["own_lm_heads"]
    assert own.params["lm_heads"].shape == (3, target.cfg.hidden_size, 30)
    assert h_own[0]["loss"] == pytest.approx(h_shared[0]["loss"], rel=1e-5)
    lm = np.asarray(own.params["lm_heads"])
    assert np.abs(lm[0] - lm[1]).max() > 0  # trained apart
    from spec_jax.heads.registry import save_draft

    save_draft(own, tmp_path / "heads")
    loaded = spec_jax.load_draft(tmp_path / "heads")
    plain = spec_jax.generate_batch(target, prompts[:4], 20, stop_at_eos=False)
    for tree in ("[[0],[1],[0,0]]", "dynamic:2,3,6"):
        spec = spec_jax.generate_batch(target, prompts[:4], 20, draft=loaded, tree=tree,
                                       stop_at_eos=False)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert mean_tau(target, prompts, loaded) > 2.0
    fresh = spec_jax.init_draft(target, "medusa", num_heads=2, own_lm_heads=True)
    assert fresh.params["lm_heads"].shape == (2, target.cfg.hidden_size, target.cfg.vocab_size)
