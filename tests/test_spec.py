"""Speculative decoding on tiny random models: greedy output equals plain decoding for every
drafter, tree and prompt length; stats are right on a hand-counted example."""
import numpy as np
import pytest

import spec_jax
from spec_jax.errors import SpecJaxError
from tests.conftest import tiny_config

# a switch of three 4-token arms: the head's tree, a chain + 2 n-gram tokens, the root + 3
SWITCH = {"switch": [{"base": [[0], [1], [0, 0]], "ngram": 0}, {"base": [[0]], "ngram": 2},
                     {"base": [], "ngram": 3}], "policy": [0, 1, 2]}
SMALL_TREES = {
    "eagle": ["dynamic:3,3,8", "chain:2", "mc_sim_7b_63", "dynamic:3,3,8+ngram:3", SWITCH],
    "eagle3": ["dynamic:2,4,7", "[[0],[1],[0,0],[1,0],[0,1],[0,0,0]]"],
    "mtp": [None, "[[0],[1],[0,0],[0,0,0],[0,0,1]]"],
    "medusa": ["[[0],[1],[0,0],[1,0],[0,1],[0,0,0]]", "chain:2", "chain:2+ngram:4", SWITCH,
               "dynamic:3,3,8", "dynamic:2,4,6+ngram:3"],
}


@pytest.fixture(scope="module")
def heads(tiny_target):
    kw = {"eagle3": {"draft_vocab": 48}, "mtp": {"num_modules": 2, "depth": 3}}
    return {m: spec_jax.init_draft(tiny_target, m, seed=7, scale=0.3, **kw.get(m, {}))
            for m in SMALL_TREES}


@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp"])
def test_draft_vocabulary_stays_lossless_and_proposes_only_its_tokens(tiny_target, method):
    """Heads over the target's LM head restricted to a draft vocabulary (even ids): every drafted
    token is in it, the bound slice drafts what the in-step gather does, and output is plain's."""
    import jax
    import jax.numpy as jnp

    from spec_jax.heads.vocab import bind_target

    kw = {"mtp": {"depth": 3}}.get(method, {})
    h = spec_jax.init_draft(tiny_target, method, seed=7, scale=0.3, d2t=np.arange(0, 64, 2), **kw)
    assert h.hparams["draft_vocab"] == 32 and "d2t" not in h.hparams
    bound = bind_target(h.params, tiny_target.params, tiny_target.cfg)
    assert bound["lm_sub"].shape == (tiny_target.cfg.hidden_size, 32)
    d = h.drafter()
    cfg, tp = tiny_target.cfg, tiny_target.params
    hidden = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cfg.hidden_size))
    for p in (h.params, bound):  # unbound (gather in the step) and bound give the same logits
        if method == "medusa":
            out = d.propose(p, tp, cfg, d.init_state(p, tp, cfg, 2, 8).replace(hidden=hidden[:, 0]),
                            jnp.asarray([1, 2]), None)[0].tokens[:, 1:]
        else:
            _, out = d.logp_topk(p, tp, cfg, hidden, 4)
        assert np.all(np.asarray(out) % 2 == 0), out
        if p is h.params:
            first = out
    np.testing.assert_array_equal(first, out)
    for seed, plen in [(0, 3), (1, 40)]:
        prompt = list(np.random.RandomState(seed).randint(0, 64, plen))
        plain = spec_jax.generate(tiny_target, prompt, 20, stop_at_eos=False)
        spec = spec_jax.generate(tiny_target, prompt, 20, draft=h, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids, (method, seed)


@pytest.fixture(scope="module")
def plain_tiny(tiny_target):
    """Three prompts of 1, 9 and 70 tokens and their plain greedy decoding (24 tokens), as a batch.
    The prompts repeat a 5-token pattern, which gives the n-gram drafter something to find."""
    prompts = [list(np.tile(np.random.RandomState(seed).randint(0, 64, 5), 20)[:plen])
               for seed, plen in [(0, 1), (1, 9), (2, 70)]]
    return prompts, spec_jax.generate_batch(tiny_target, prompts, 24, stop_at_eos=False)


@pytest.mark.parametrize("method,tree", [(m, t) for m, ts in SMALL_TREES.items() for t in ts]
                         + [("ngram", None)], ids=lambda x: "switch" if isinstance(x, dict) else None)
def test_greedy_speculative_equals_plain(tiny_target, heads, plain_tiny, method, tree):
    """Prompts of 1, 9 and 70 tokens, decoded as one batch (one compiled loop per tree)."""
    draft = "ngram" if method == "ngram" else heads[method]
    prompts, plain = plain_tiny
    spec = spec_jax.generate_batch(tiny_target, prompts, 24, draft=draft, tree=tree,
                                   stop_at_eos=False)
    for i, (p, r) in enumerate(zip(plain, spec)):
        assert r.token_ids == p.token_ids, (method, tree, i)
        s = r.stats
        assert s["new_tokens"] == 24
        steps = sum(s["acceptance_histogram"])
        assert s["target_calls"] == steps + 1
        # every step emits accepted + 1 tokens; the last step may be cut by max_new_tokens
        emitted = sum(i * c for i, c in enumerate(s["acceptance_histogram"])) + steps
        assert emitted >= 23 > emitted - (len(s["acceptance_histogram"]))


def test_static_tree_drafts_what_the_full_dynamic_tree_does(tiny_target, heads):
    """A complete top-2, depth-2 tree: the static path list and the dynamic tree that keeps every
    candidate propose the same tokens in the same node order."""
    import jax
    import jax.numpy as jnp

    from spec_jax.cache import cache_for
    from spec_jax.heads.base import PrefillContext
    from spec_jax.models.llama import causal_mask, forward

    h = heads["eagle"]
    static = h.drafter("[[0],[1],[0,0],[0,1],[1,0],[1,1]]")
    dynamic = h.drafter("dynamic:2,2,7")
    assert static.static_tree is not None and static.tree_size == dynamic.tree_size == 7
    cfg, tp = tiny_target.cfg, tiny_target.params
    toks = jnp.asarray([[5, 9, 2, 7, 7, 1]], jnp.int32)
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    out = forward(tp, cfg, toks, pos, cache_for(cfg, 1, 16), causal_mask(1, 6))
    ctx = PrefillContext(tokens=toks, prompt_len=jnp.asarray([6]), hidden=out.hidden,
                         aux_hidden=None, first_token=jnp.asarray([3]))
    trees = []
    for d in (static, dynamic):
        st = d.after_prefill(h.params, tp, cfg, d.init_state(h.params, tp, cfg, 1, 16), ctx)
        trees.append(d.propose(h.params, tp, cfg, st, jnp.asarray([3]), jax.random.PRNGKey(0))[0])
    for field in ("tokens", "parent", "depth", "mask"):
        np.testing.assert_array_equal(getattr(trees[0], field), getattr(trees[1], field), field)


def test_batch_speculative_rows_are_independent(tiny_target, heads):
    prompts = [[1, 2, 3], list(range(10, 50)), [7] * 12]
    batch = spec_jax.generate_batch(tiny_target, prompts, 16, draft=heads["eagle"],
                                    tree="dynamic:3,3,8", stop_at_eos=False)
    for p, r in zip(prompts, batch):
        assert r.token_ids == spec_jax.generate(tiny_target, p, 16, stop_at_eos=False).token_ids


def test_stats_on_a_hand_counted_example():
    """A target that repeats a 4-token cycle: once the cycle is in the context, the n-gram drafter
    (depth 3) proposes it exactly, so every step accepts 3 draft tokens + 1 bonus."""
    import jax.numpy as jnp

    cfg = tiny_config(vocab_size=8, num_layers=1)
    target = spec_jax.random_target(cfg, seed=0)
    # make logits depend only on the current token: next(t) = (t + 1) % 4
    p = dict(target.params)
    p["layers"] = {k: (v * 0 if k in ("wo", "w_down") else v) for k, v in p["layers"].items()}
    emb = jnp.eye(8, 32) * 10.0
    p["embed"] = emb
    nxt = (jnp.arange(8) + 1) % 4
    p["lm_head"] = jnp.zeros((32, 8)).at[jnp.arange(8), nxt].set(1.0)
    p["final_norm"] = jnp.ones((32,))
    target.params = p
    prompt = [0, 1, 2, 3, 0, 1]
    plain = spec_jax.generate(target, prompt, 13, stop_at_eos=False)
    assert plain.token_ids == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    r = spec_jax.generate(target, prompt, 13, draft="ngram", tree="chain:3", stop_at_eos=False)
    assert r.token_ids == plain.token_ids
    # prefill emits 1 token; then 3 steps of 4 tokens = 13
    assert r.stats["acceptance_histogram"] == [0, 0, 0, 3]
    assert r.stats["target_calls"] == 4
    assert r.stats["mean_accepted"] == 4.0


def test_random_heads_accept_little_but_work(tiny_target, heads):
    r = spec_jax.generate(tiny_target, [5, 6, 7], 30, draft=heads["eagle"], tree="dynamic:3,3,8",
                          stop_at_eos=False)
    assert r.stats["new_tokens"] == 30 and r.stats["mean_accepted"] < 2.0


def test_medusa_tree_deeper_than_heads_is_an_error(tiny_target, heads):
    with pytest.raises(SpecJaxError, match="exceeds the 4 Medusa heads"):
        spec_jax.generate(tiny_target, [1], 4, draft=heads["medusa"], tree="chain:5")


def test_dynamic_medusa_tree_keeps_the_best_scored_paths(tiny_target, heads):
    """dynamic:K,D,N on Medusa heads: the N - 1 nodes of highest summed head log-probability among
    the candidates (a depth-d node: a top-K child of one of the K best nodes at depth d - 1)."""
    import jax
    import jax.numpy as jnp

    from spec_jax.heads.medusa import medusa_logits

    h = heads["medusa"]
    cfg, tp = tiny_target.cfg, tiny_target.params
    hidden = jax.random.normal(jax.random.PRNGKey(3), (3, cfg.hidden_size))
    logp = np.asarray(jax.nn.log_softmax(medusa_logits(h.params, tp, cfg, hidden), -1))
    k, depth, n = 3, 3, 9
    d = h.drafter(f"dynamic:{k},{depth},{n}")
    assert (d.tree_size, d.max_depth, d.max_children) == (n, depth, k)
    tree = d.propose(h.params, tp, cfg, d.init_state(h.params, tp, cfg, 3, 8).replace(hidden=hidden),
                     jnp.asarray([5, 6, 7]), None)[0]
    for b in range(3):
        top = np.argsort(-logp[b], axis=-1, kind="stable")[:, :k]  # [heads, k]
        pool, frontier = {}, [()]
        for dd in range(depth):
            cands = {p + (t,): sum(logp[b, i, q] for i, q in enumerate(p + (t,)))
                     for p in frontier for t in top[dd]}
            pool.update(cands)
            frontier = sorted(cands, key=lambda p: -cands[p])[:k]
        want = set(sorted(pool, key=lambda p: -pool[p])[:n - 1])
        tok, par = np.asarray(tree.tokens[b]), np.asarray(tree.parent[b])

        def path(i):
            return () if i == 0 else path(par[i]) + (int(tok[i]),)

        assert tok[0] == 5 + b and {path(i) for i in range(1, n)} == want
        assert np.all(np.asarray(tree.depth[b]) == [len(path(i)) for i in range(n)])
    with pytest.raises(SpecJaxError, match="tree of 8 tokens with top_k 2 and depth 2"):
        h.drafter("dynamic:2,2,8")


def test_heads_for_another_target_are_refused(tiny_target, heads):
    other = spec_jax.random_target(tiny_config(), seed=1)
    with pytest.raises(SpecJaxError, match="trained for another target"):
        spec_jax.generate(other, [1], 4, draft=heads["eagle"])


@pytest.mark.parametrize("method", ["eagle", "plain"])
def test_greedy_with_pallas_interpret_attention_equals_plain(tiny_target, heads, method):
    draft = heads["eagle"] if method == "eagle" else None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = spec_jax.generate(tiny_target, prompt, 10, stop_at_eos=False)
    r = spec_jax.generate(tiny_target, prompt, 10, draft=draft, tree="dynamic:2,2,4",
                          attn_impl="pallas_interpret", stop_at_eos=False)
    assert r.token_ids == plain.token_ids


def test_a_one_token_tree_means_plain_decoding(tiny_target, heads):
    """Calibration may find that no tree pays on this hardware: 'dynamic:0,0,1' is plain decoding."""
    from spec_jax.heads.base import Drafter

    assert type(heads["eagle"].drafter("dynamic:0,0,1")) is Drafter
    r = spec_jax.generate(tiny_target, [1, 2, 3], 8, draft=heads["eagle"], tree="dynamic:0,0,1",
                          stop_at_eos=False)
    assert r.token_ids == spec_jax.generate(tiny_target, [1, 2, 3], 8, stop_at_eos=False).token_ids
    assert r.stats["method"] == "none"


def test_switch_rows_take_their_own_arms(tiny_target, heads):
    """In one batch a row whose context repeats takes an n-gram arm, a row whose context does
    not takes the head's tree, and both still decode exactly as plain greedy decoding."""
    import jax.numpy as jnp

    from spec_jax.drafting import build
    from spec_jax.heads.ngram import NgramState

    d = build(tiny_target, heads["eagle"], SWITCH)[0]
    hist = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, 0], [1, 2, 3, 9, 1, 2, 3, 0]], jnp.int32)
    arm, chain, valid = d.choice((None, NgramState(hist=hist, hlen=jnp.asarray([6, 7]))))
    np.testing.assert_array_equal(arm, [0, 2])  # no earlier match; "1 2 3" matched (length 3)
    np.testing.assert_array_equal(chain[1][:1], [9])
    assert d.tree_size == 4 and d.method == "eagle+switch"
    prompts = [list(range(10, 40)), [5, 6, 7, 8] * 8]
    batch = spec_jax.generate_batch(tiny_target, prompts, 20, draft=heads["eagle"], tree=SWITCH,
                                    stop_at_eos=False)
    for p, r in zip(prompts, batch):
        assert r.token_ids == spec_jax.generate(tiny_target, p, 20, stop_at_eos=False).token_ids


def test_a_malformed_switch_is_refused(tiny_target, heads):
    import json

    from spec_jax.drafting import build

    arms = [{"base": [[0]], "ngram": 1}, {"base": [], "ngram": 1}]
    with pytest.raises(SpecJaxError, match="differ in tree tokens"):
        build(tiny_target, heads["eagle"], {"switch": arms, "policy": [0, 1]})
    with pytest.raises(SpecJaxError, match="policy"):
        build(tiny_target, heads["eagle"], {"switch": arms[:1], "policy": [0, 1]})
    # as the CLI's --tree passes it
    assert build(tiny_target, heads["eagle"], json.dumps(SWITCH))[0].tree_size == 4
    with pytest.raises(SpecJaxError, match="as JSON"):
        build(tiny_target, heads["eagle"], '{"switch": [oops')
    with pytest.raises(SpecJaxError, match="drafting.build"):  # heads alone draft base trees
        heads["eagle"].drafter(SWITCH)


def test_a_graft_written_as_json_text_drafts_as_its_dict(tiny_target, heads):
    """--tree and --drafts pass sizing choices such as {"base": ..., "ngram": 4} as JSON text."""
    prompt = list(np.tile(np.arange(5), 8))
    kw = dict(draft=heads["eagle"], stop_at_eos=False)
    as_dict = spec_jax.generate(tiny_target, prompt, 12, tree={"base": [[0], [1]], "ngram": 3}, **kw)
    as_text = spec_jax.generate(tiny_target, prompt, 12, tree='{"base": [[0], [1]], "ngram": 3}', **kw)
    assert as_text.token_ids == as_dict.token_ids
    assert as_text.stats["acceptance_histogram"] == as_dict.stats["acceptance_histogram"]
    assert len(as_text.stats["acceptance_histogram"]) == 4  # 0..3 accepted: the graft is on


def test_a_two_layer_eagle_head_caches_each_layer_and_stays_lossless(tiny_target, heads):
    """An EAGLE head with a second decoder layer: its draft cache, filled in two chunks, gives the
    features of one teacher-forced pass (so each layer keeps its own K/V); greedy output is
    plain's; a trained head grown by an identity layer drafts exactly what it did."""
    import jax
    import jax.numpy as jnp

    from spec_jax.heads.eagle import add_layers, num_layers_of
    from spec_jax.train.losses import _shift, unrolled_features

    cfg, tp = tiny_target.cfg, tiny_target.params
    h2 = spec_jax.init_draft(tiny_target, "eagle", seed=3, scale=0.3, num_layers=2)
    assert num_layers_of(h2.params) == 2 and h2.hparams["num_layers"] == 2
    d = h2.drafter()
    assert d.num_layers == 2
    b, n = 2, 12
    toks = jax.random.randint(jax.random.PRNGKey(0), (b, n), 0, 64)
    feats = jax.random.normal(jax.random.PRNGKey(1), (b, n, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    nxt, ok = _shift(toks, 1), jnp.ones((b, n), bool)
    st = d.init_state(h2.params, tp, cfg, b, 32)
    assert len(st.cache.k) == 2
    whole = d._run_chunk(h2.params, tp, cfg, st, feats, nxt, pos, ok)
    part = d._run_chunk(h2.params, tp, cfg, st, feats[:, :5], nxt[:, :5], pos[:, :5], ok[:, :5])
    part = d._run_chunk(h2.params, tp, cfg, part, feats[:, 5:], nxt[:, 5:], pos[:, 5:], ok[:, 5:])
    ref = unrolled_features(d, h2.params, tp, cfg, toks, feats, 1)[0][:, -1]
    np.testing.assert_allclose(whole.root_feat, ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(part.root_feat, ref, rtol=2e-4, atol=2e-4)
    for tree in ("dynamic:3,3,8", "[[0],[1],[0,0],[0,0,0]]"):
        prompt = list(np.tile(np.arange(5), 4))
        plain = spec_jax.generate(tiny_target, prompt, 16, stop_at_eos=False)
        spec = spec_jax.generate(tiny_target, prompt, 16, draft=h2, tree=tree, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids, tree
    one = heads["eagle"]
    grown = spec_jax.heads.registry.DraftHeads(
        "eagle", add_layers(one.params, cfg, 2, jax.random.PRNGKey(5)),
        {**one.hparams, "num_layers": 2}, one.target_info)
    assert num_layers_of(grown.params) == 2
    roots = []
    for h in (one, grown):
        dd = h.drafter()
        s0 = dd.init_state(h.params, tp, cfg, b, 32)
        roots.append(dd._run_chunk(h.params, tp, cfg, s0, feats, nxt, pos, ok).root_tok)
    np.testing.assert_array_equal(roots[0], roots[1])


@pytest.mark.parametrize("method,tree", [("eagle", "dynamic:3,3,8+ngram:3"), ("eagle3", "chain:2"),
                                         ("medusa", "chain:2"), ("mtp", None), ("ngram", None)])
def test_plain_fallback_decodes_as_plain_and_greedy(tiny_target, heads, plain_tiny, method, tree):
    """A break-even no tree reaches: after the first tree step each row takes plain steps, and
    a tree step again once its mean has drifted back above the break-even; a batch's rows still
    decode exactly as plain greedy."""
    draft = "ngram" if method == "ngram" else heads[method]
    prompts, plain = plain_tiny
    spec = spec_jax.generate_batch(tiny_target, prompts, 40, draft=draft, tree=tree,
                                   stop_at_eos=False, fallback=(2.5, 3.0))
    plain40 = spec_jax.generate_batch(tiny_target, prompts, 40, stop_at_eos=False)
    for p, r in zip(plain40, spec):
        assert r.token_ids == p.token_ids, (method, tree)
        s = r.stats
        trees = sum(s["acceptance_histogram"]) - s["plain_steps"]
        # random heads accept ~1 token: from 3.0, two tree steps bring the mean below 2.5, and
        # then about 9 plain steps (each closing 1/16 of the gap to 3.0) bring it back
        assert s["plain_steps"] >= 20 and 3 <= trees <= 12, s
    off = spec_jax.generate_batch(tiny_target, prompts, 24, draft=draft, tree=tree,
                                  stop_at_eos=False, fallback=False)
    assert all(r.stats["plain_steps"] == 0 for r in off)


def test_plain_fallback_hands_the_drafter_its_skipped_tokens_at_once(tiny_target, heads):
    """`Fallback.flush` gives a drafter the state that one-token steps would have: a
    chunk of buffered plain steps equals the same tokens accepted one at a time."""
    import jax
    import jax.numpy as jnp

    from spec_jax.fallback import Fallback
    from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
    from spec_jax.models.llama import causal_mask, forward

    cfg, tp = tiny_target.cfg, tiny_target.params
    for method in ("eagle", "eagle3"):
        h = heads[method]
        inner = h.drafter("chain:2")
        d, fbp = inner, Fallback(plain_below=9.0, prior=10.0, window=8)
        dp = h.bind(tiny_target)
        toks = jnp.asarray([[3, 9, 4, 1, 7, 2, 8, 5, 6, 11, 12, 13]], jnp.int32)
        p, n = 4, 6  # prompt, then n tokens through plain steps
        cache = tiny_target.new_cache(1, 32)
        pos = jnp.arange(toks.shape[1])[None]
        fwd = forward(tp, cfg, toks, pos, cache, causal_mask(1, toks.shape[1]),
                      aux_layers=d.aux_layers)
        state = d.after_prefill(dp, tp, cfg, d.init_state(dp, tp, cfg, 1, 32), PrefillContext(
            tokens=toks[:, :p], prompt_len=jnp.asarray([p]), hidden=fwd.hidden[:, :p],
            aux_hidden=None if fwd.aux_hidden is None else fwd.aux_hidden[:, :p],
            first_token=toks[:, p]))
        one_by_one, fb = state, fbp.init(d, cfg, 1, fwd.hidden.dtype)
        active = jnp.asarray([True])
        for i in range(p, p + n):
            aux = None if fwd.aux_hidden is None else fwd.aux_hidden[:, i:i + 1]
            tree, _ = Drafter().propose((), tp, cfg, (), toks[:, i], None)
            one_by_one = d.after_verify(dp, tp, cfg, one_by_one, VerifyContext(
                tree=tree, path=jnp.zeros((1, 1), jnp.int32), n_accepted=jnp.asarray([1]),
                bonus=toks[:, i + 1], hidden=fwd.hidden[:, i:i + 1], aux_hidden=aux,
                root_pos=jnp.asarray([i]), active=active))
            fb = fbp.buffer(fb, toks[:, i], fwd.hidden[:, i], None if aux is None else aux[:, 0],
                          jnp.asarray([i]), active)
        chunked, fb = fbp.flush(d, dp, tp, cfg, state, fb, toks[:, p + n])
        assert int(fb.count[0]) == 0 and int(fb.plain[0]) == n
        for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(chunked)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=1e-5, atol=1e-5, err_msg=method)
