"""Published draft heads: checkpoints built here with exactly the published tensor names, shapes
and config fields (random weights), imported onto a tiny target, checked against an independent
PyTorch forward of the published architecture, decoded with, exported and re-imported."""
import json
import math
import sys

import numpy as np
import pytest

import spec_jax
from spec_jax.errors import SpecJaxError
from tests.conftest import tiny_config

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

CFG = tiny_config(num_layers=8)  # EAGLE-3 fuses layers 2, L//2, L-3: three distinct with L=8
H, V, I_ = CFG.hidden_size, CFG.vocab_size, CFG.intermediate_size
NQ, NKV = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
SEQ = [3, 17, 5, 60, 22, 9, 41, 0, 33, 12, 7, 51]
PROMPT = [3, 17, 5, 60, 22, 9]


@pytest.fixture(scope="module")
def target():
    import jax

    t = spec_jax.random_target(CFG, seed=1, scale=0.3)
    # a final norm that is not all ones: features before and after it then differ in direction
    t.params["final_norm"] = 1 + 0.3 * jax.random.normal(jax.random.PRNGKey(7), (H,))
    return t


def _rng(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, s=0.3: torch.randn(*shape, generator=g) * s


# ---------------------------------------------------------------- an independent PyTorch reference

def t_rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * w


def t_rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (CFG.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def t_attn(sd, pre, x):
    """Llama self-attention (causal, GQA) of x [T, in] with `pre`self_attn.* weights."""
    t = x.shape[0]
    lin = lambda n: x @ sd[pre + n + ".weight"].T + (sd[pre + n + ".bias"]  # noqa: E731
                                                     if pre + n + ".bias" in sd else 0)
    d = CFG.head_dim
    q = lin("q_proj").view(t, -1, d)
    k = lin("k_proj").view(t, -1, d)
    v = lin("v_proj").view(t, -1, d)
    pos = torch.arange(t)
    q, k = t_rope(q, pos), t_rope(k, pos)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -math.inf)
    a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1)
    return a @ sd[pre + "o_proj.weight"].T


def t_mlp(sd, pre, x):
    g = x @ sd[pre + "gate_proj.weight"].T
    return (torch.nn.functional.silu(g) * (x @ sd[pre + "up_proj.weight"].T)) @ \
        sd[pre + "down_proj.weight"].T


def t_layer(sd, pre, x, input_norm=True):
    h = t_rms(x, sd[pre + "input_layernorm.weight"]) if input_norm else x
    x = x + t_attn(sd, pre + "self_attn.", h)
    return x + t_mlp(sd, pre + "mlp.", t_rms(x, sd[pre + "post_attention_layernorm.weight"]))


def hf_target(target):
    """The tiny target's weights under Hugging Face Llama names, float64 torch tensors."""
    p = target.params
    t = lambda a: torch.tensor(np.asarray(a, np.float64))  # noqa: E731
    sd = {"model.embed_tokens.weight": t(p["embed"]), "model.norm.weight": t(p["final_norm"]),
          "lm_head.weight": t(np.asarray(p["lm_head"]).T)}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i in range(CFG.num_layers):
        for k, n in names.items():
            sd[f"model.layers.{i}.{n}.weight"] = t(np.asarray(p["layers"][k][i]).T)
        sd[f"model.layers.{i}.input_layernorm.weight"] = t(p["layers"]["attn_norm"][i])
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = t(p["layers"]["mlp_norm"][i])
    return sd


def t_target(sd, ids):
    """-> (inputs of every layer [L][T, H], last hidden state after the final norm [T, H])."""
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    ins = []
    for i in range(CFG.num_layers):
        ins.append(x)
        x = t_layer(sd, f"model.layers.{i}.", x)
    return ins, t_rms(x, sd["model.norm.weight"])


def ref_logits(fmt, sd_head, sd_t, ids, conf):
    """The published architecture's first draft step, rows j = 0..n-2 (token j+2), [n-1, V]."""
    ins, h_post = t_target(sd_t, ids)
    n = len(ids)
    emb = sd_t["model.embed_tokens.weight"][torch.tensor(ids[1:])]  # token j+1 at row j
    hp = h_post[: n - 1]
    lm = sd_t["lm_head.weight"]
    if fmt == "eagle":  # cnets1: fc(cat(emb, h)), layers (layer 0 without input norm), target head
        x = torch.cat([emb, hp], -1) @ sd_head["fc.weight"].T + sd_head.get("fc.bias", 0)
        for i in range(conf["num_hidden_layers"]):
            x = t_layer(sd_head, f"layers.{i}.", x, input_norm=i > 0)
        return x @ lm.T
    if fmt == "eagle3":  # cnets: fc(h3); cat(input_norm(emb), hidden_norm(res)) -> q/k/v
        L = CFG.num_layers
        h3 = torch.cat([ins[2], ins[L // 2], ins[L - 3]], -1)[: n - 1]
        res = h3 @ sd_head["fc.weight"].T
        m = "midlayer."
        x = torch.cat([t_rms(emb, sd_head[m + "input_layernorm.weight"]),
                       t_rms(res, sd_head[m + "hidden_norm.weight"])], -1)
        x = res + t_attn(sd_head, m + "self_attn.", x)
        x = x + t_mlp(sd_head, m + "mlp.", t_rms(x, sd_head[m + "post_attention_layernorm.weight"]))
        dl = t_rms(x, sd_head["norm.weight"]) @ sd_head["lm_head.weight"].T  # [n-1, Vd]
        out = torch.full((n - 1, V), -math.inf, dtype=torch.float64)
        d2t = sd_head["d2t"].long()
        out[:, torch.arange(len(d2t)) + d2t] = dl
        return out
    if fmt == "medusa":  # head 0: R ResBlocks x + SiLU(Wx + b), then its own LM head
        z, n = hp, conf["medusa_num_layers"]
        for j in range(n):  # a block the file leaves out is block 0: the published code's one
            j = j if f"0.{j}.linear.weight" in sd_head else 0  # module, repeated
            z = z + torch.nn.functional.silu(z @ sd_head[f"0.{j}.linear.weight"].T
                                             + sd_head[f"0.{j}.linear.bias"])
        return z @ sd_head[f"0.{n}.weight"].T
    if fmt == "mtp-deepseek":
        p = f"model.layers.{CFG.num_layers}."
        x = torch.cat([t_rms(emb, sd_head[p + "enorm.weight"]),
                       t_rms(hp, sd_head[p + "hnorm.weight"])], -1) @ sd_head[p + "eh_proj.weight"].T
        x = t_layer(sd_head, p, x)
        return t_rms(x, sd_head[p + "shared_head.norm.weight"]) @ sd_head[p + "shared_head.head.weight"].T
    if fmt == "mtp-mimo":
        p = "model.mtp_layers.0."
        x = torch.cat([t_rms(hp, sd_head[p + "hidden_layernorm.weight"]),
                       t_rms(emb, sd_head[p + "token_layernorm.weight"])], -1) \
            @ sd_head[p + "input_proj.weight"].T
        x = t_layer(sd_head, p, x)
        return t_rms(x, sd_head[p + "final_layernorm.weight"]) @ lm.T
    raise AssertionError(fmt)


# ---------------------------------------------------------------- published checkpoints, built here

def llama_conf(**kw):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": I_, "num_attention_heads": CFG.num_heads,
            "num_key_value_heads": CFG.num_kv_heads, "num_hidden_layers": 1, "vocab_size": V,
            "rms_norm_eps": CFG.rms_norm_eps, "rope_theta": CFG.rope_theta,
            "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float16", **kw}


def layer_sd(r, pre, in_dim=H, input_norm=True, qkv_bias=False):
    a, m = pre + "self_attn.", pre + "mlp."
    sd = {a + "q_proj.weight": r(NQ, in_dim), a + "k_proj.weight": r(NKV, in_dim),
          a + "v_proj.weight": r(NKV, in_dim), a + "o_proj.weight": r(H, NQ),
          m + "gate_proj.weight": r(I_, H), m + "up_proj.weight": r(I_, H),
          m + "down_proj.weight": r(H, I_),
          pre + "post_attention_layernorm.weight": 1 + r(H, s=0.1)}
    if input_norm:
        sd[pre + "input_layernorm.weight"] = 1 + r(H, s=0.1)
    if qkv_bias:
        sd.update({a + "q_proj.bias": r(NQ), a + "k_proj.bias": r(NKV), a + "v_proj.bias": r(NKV)})
    return sd


def make_eagle(d, vicuna: bool, seed=0, hidden=H):
    """LLaMA3-style (no fc bias, one layer, pytorch_model.bin) or Vicuna-style (fc bias, q/k/v
    bias, a second layer with its input norm; safetensors)."""
    r = _rng(seed)
    n = 2 if vicuna else 1
    sd = {"fc.weight": r(hidden, 2 * hidden, s=0.2)}
    if vicuna:
        sd["fc.bias"] = r(hidden)
    for i in range(n):
        sd.update(layer_sd(r, f"layers.{i}.", input_norm=i > 0, qkv_bias=vicuna)
                  if hidden == H else {})
    conf = llama_conf(num_hidden_layers=n, bias=vicuna, hidden_size=hidden)
    if vicuna:
        conf["qkv_bias"] = True
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    if vicuna:
        save_file(sd, str(d / "model.safetensors"))
    else:
        torch.save(sd, d / "pytorch_model.bin")
    return sd, conf


def make_eagle3(d, seed=0, vd=48):
    r = _rng(seed)
    sd = layer_sd(r, "midlayer.", in_dim=2 * H)
    sd.update({"midlayer.hidden_norm.weight": 1 + r(H, s=0.1), "fc.weight": r(H, 3 * H, s=0.2),
               "norm.weight": 1 + r(H, s=0.1), "lm_head.weight": r(vd, H)})
    ids = np.sort(np.random.default_rng(seed).choice(V, vd, replace=False))
    sd["d2t"] = torch.tensor(ids - np.arange(vd), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.tensor(ids)] = True
    sd["t2d"] = t2d
    conf = llama_conf(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vd,
                      target_hidden_size=H)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    save_file(sd, str(d / "model.safetensors"))
    return sd, conf


def make_medusa(d, seed=0, k=3, layers=1):
    """Heads with `layers` ResBlocks of their own each (as text-generation-inference loads them)."""
    r = _rng(seed)
    sd = {}
    for i in range(k):
        for j in range(layers):
            sd.update({f"{i}.{j}.linear.weight": r(H, H), f"{i}.{j}.linear.bias": r(H)})
        sd[f"{i}.{layers}.weight"] = r(V, H)
    conf = {"medusa_num_heads": k, "medusa_num_layers": layers,
            "base_model_name_or_path": "tiny-llama"}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    save_file(sd, str(d / "medusa_lm_head.safetensors"))
    return sd, conf


def make_medusa_official(d, seed=0, k=2, layers=3, dedup=False):
    """Heads as FasterDecoding/Medusa builds them, `nn.Sequential(*([ResBlock(H)] * layers),
    Linear(H, V))`: one ResBlock module repeated. torch.save of its state_dict (the training
    script's medusa_lm_head.pt) holds every `{i}.{j}.linear.*`, equal; a deduplicating
    safetensors save (`save_model`) keeps block 0 alone."""
    from safetensors.torch import save_model

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(H, H)

    torch.manual_seed(seed)
    heads = torch.nn.ModuleList([torch.nn.Sequential(*([ResBlock()] * layers),
                                                     torch.nn.Linear(H, V, bias=False))
                                 for _ in range(k)])
    with torch.no_grad():
        for prm in heads.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    conf = {"medusa_num_heads": k, "medusa_num_layers": layers,
            "base_model_name_or_path": "tiny-llama"}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    if dedup:
        save_model(heads, str(d / "medusa_lm_head.safetensors"))
        from safetensors.torch import load_file

        return load_file(str(d / "medusa_lm_head.safetensors")), conf
    sd = heads.state_dict()
    assert sd["0.0.linear.weight"].data_ptr() == sd[f"0.{layers - 1}.linear.weight"].data_ptr()
    torch.save(sd, d / "medusa_lm_head.pt")
    return {n: t.clone() for n, t in sd.items()}, conf


def make_mtp(d, sd_t, mimo: bool, seed=0):
    """A target checkpoint with its MTP layer (DeepSeek-V3 or MiMo names) beside its layers."""
    r = _rng(seed)
    sd = {k: v.float() for k, v in sd_t.items()}
    if mimo:
        p = "model.mtp_layers.0."
        head = layer_sd(r, p, qkv_bias=True)
        head.update({p + "token_layernorm.weight": 1 + r(H, s=0.1),
                     p + "hidden_layernorm.weight": 1 + r(H, s=0.1),
                     p + "input_proj.weight": r(H, 2 * H, s=0.2),
                     p + "final_layernorm.weight": 1 + r(H, s=0.1)})
        conf = llama_conf(architectures=["MiMoForCausalLM"], num_hidden_layers=CFG.num_layers,
                          num_nextn_predict_layers=1)
    else:
        p = f"model.layers.{CFG.num_layers}."
        head = layer_sd(r, p)
        head.update({p + "enorm.weight": 1 + r(H, s=0.1), p + "hnorm.weight": 1 + r(H, s=0.1),
                     p + "eh_proj.weight": r(H, 2 * H, s=0.2),
                     p + "shared_head.norm.weight": 1 + r(H, s=0.1),
                     p + "shared_head.head.weight": sd["lm_head.weight"].clone()})
        conf = llama_conf(architectures=["DeepseekV3ForCausalLM"],
                          num_hidden_layers=CFG.num_layers, num_nextn_predict_layers=1)
    sd.update(head)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    names = sorted(sd)
    half = len(names) // 2  # sharded, with an index, as published targets are
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: sd[n].contiguous() for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    return sd, conf


def as64(sd):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}


CASES = {  # name -> (import format, builder)
    "eagle-llama3-bin": ("eagle", lambda d, t: make_eagle(d, vicuna=False)),
    "eagle-vicuna": ("eagle", lambda d, t: make_eagle(d, vicuna=True)),
    "eagle3": ("eagle3", lambda d, t: make_eagle3(d)),
    "medusa": ("medusa", lambda d, t: make_medusa(d)),
    "medusa-2-layers": ("medusa", lambda d, t: make_medusa(d, seed=1, layers=2)),
    "medusa-official-pt": ("medusa", lambda d, t: make_medusa_official(d)),
    "medusa-official-dedup": ("medusa", lambda d, t: make_medusa_official(d, layers=2, dedup=True)),
    "mtp-deepseek": ("mtp", lambda d, t: make_mtp(d, hf_target(t), mimo=False)),
    "mtp-mimo": ("mtp", lambda d, t: make_mtp(d, hf_target(t), mimo=True)),
}


def ref_kind(name):
    return name if name.startswith("mtp") else CASES[name][0]


@pytest.fixture(scope="module")
def imported(tmp_path_factory, target):
    """Every case imported to a heads directory: name -> (src dir, published sd, conf, heads dir)."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    for name, (fmt, build) in CASES.items():
        src = root / name
        sd, conf = build(src, target)
        dst = root / f"{name}-heads"
        spec_jax.import_heads(fmt, src, target, out=dst)
        out[name] = (src, sd, conf, dst)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_draft_logits_match_the_published_architecture(imported, target, name):
    src, sd, conf, dst = imported[name]
    heads = spec_jax.load_draft(dst)
    got = spec_jax.draft_logits(target, heads, SEQ)
    want = ref_logits(ref_kind(name), as64(sd), hf_target(target), SEQ, conf).numpy()
    assert got.shape == (len(SEQ) - 1, V)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=1e-4, rtol=1e-4)
    assert np.abs(want[fin]).max() > 0.1  # not trivially zero


TREES = {  # between them every kind of tree option: the method's own, static, chain, dynamic
    "eagle-llama3-bin": [[[0], [1], [0, 0]]], "eagle-vicuna": ["chain:2"], "eagle3": [None],
    "medusa": ["dynamic:3,2,5"], "mtp-deepseek": [None], "mtp-mimo": [None],
    "medusa-2-layers": [None]}


@pytest.mark.parametrize("name", list(TREES))
def test_greedy_speculative_decoding_with_imported_heads_is_plain_decoding(imported, target, name):
    heads = spec_jax.load_draft(imported[name][3])
    plain = spec_jax.generate(target, PROMPT, 10, stop_at_eos=False).token_ids
    for tree in TREES[name]:
        # no fallback to plain steps: every step drafts and verifies a tree
        r = spec_jax.generate(target, PROMPT, 10, stop_at_eos=False, draft=heads, tree=tree,
                              fallback=False)
        assert r.stats["tree_tokens"] > 1 and r.stats["plain_steps"] == 0, (name, tree)
        assert r.token_ids == plain, (name, tree)


@pytest.mark.parametrize("name", ["eagle-llama3-bin", "eagle-vicuna", "eagle3", "medusa",
                                  "medusa-2-layers", "medusa-official-pt"])
def test_export_then_import_round_trips_bit_for_bit(imported, target, tmp_path, name):
    from safetensors.numpy import load_file

    src, sd, conf, dst = imported[name]
    fmt = CASES[name][0]
    exp = tmp_path / "exported"
    spec_jax.export_heads(fmt, dst, exp)
    files = sorted(p.name for p in exp.iterdir())
    weights = "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"
    assert files == sorted(["config.json", weights])
    got = load_file(str(exp / weights))
    assert sorted(got) == sorted(sd)  # exactly the published names
    for k, v in sd.items():
        assert np.array_equal(got[k], v.numpy()), k
    assert json.loads((exp / "config.json").read_text()) == conf
    again = spec_jax.import_heads(fmt, exp, target)
    a = spec_jax.draft_logits(target, spec_jax.load_draft(dst), SEQ)
    b = spec_jax.draft_logits(target, again, SEQ)
    assert np.array_equal(a, b)


def test_fresh_heads_export_with_the_target_and_import_back(target, tmp_path):
    heads = spec_jax.init_draft(target, "medusa", num_heads=2, scale=0.3)
    with pytest.raises(SpecJaxError, match="pass --target"):
        spec_jax.export_heads("medusa", heads, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    spec_jax.export_heads("medusa", heads, tmp_path / "m", target=target)
    back = spec_jax.import_heads("medusa", tmp_path / "m", target)
    np.testing.assert_array_equal(spec_jax.draft_logits(target, heads, SEQ),
                                  spec_jax.draft_logits(target, back, SEQ))


VOCAB = np.sort(np.random.default_rng(3).choice(V, 40, replace=False))
FRESH = {  # heads made here: a draft vocabulary, LM heads of their own, several ResBlocks
    "eagle-draft-vocab": ("eagle", dict(d2t=VOCAB)),
    "medusa-draft-vocab": ("medusa", dict(num_heads=2, d2t=VOCAB)),
    "medusa-own-draft-vocab": ("medusa", dict(num_heads=2, own_lm_heads=True, d2t=VOCAB)),
    "medusa-3-layers": ("medusa", dict(num_heads=2, num_layers=3)),
}


@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_heads_round_trip_bit_for_bit(target, tmp_path, name):
    """Export then import gives the same params, bit for bit (a draft vocabulary travels in
    draft_vocab.safetensors; a target LM head copied into Medusa heads is read back as the
    target's), and the weights file holds only the published names."""
    import jax
    from safetensors.numpy import load_file

    from spec_jax.convert.heads_io import DRAFT_VOCAB

    fmt, hp = FRESH[name]
    heads = spec_jax.init_draft(target, fmt, scale=0.3, **hp)
    if "lm_heads" in heads.params:  # trained away from the target's (equal ones import as it)
        lm = heads.params["lm_heads"]
        heads.params["lm_heads"] = lm + 0.1 * jax.random.normal(jax.random.PRNGKey(2), lm.shape)
    spec_jax.export_heads(fmt, heads, tmp_path / "x", target=target)
    back = spec_jax.import_heads(fmt, tmp_path / "x", target)
    flat = lambda h: {jax.tree_util.keystr(k): np.asarray(a)  # noqa: E731
                      for k, a in jax.tree_util.tree_leaves_with_path(h.params)}
    a, b = flat(heads), flat(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    weights = load_file(str(tmp_path / "x" / ("model.safetensors" if fmt == "eagle"
                                              else "medusa_lm_head.safetensors")))
    assert not {"d2t", "t2d"} & set(weights)
    assert (tmp_path / "x" / DRAFT_VOCAB).is_file() == ("d2t" in hp)
    if name == "medusa-own-draft-vocab":  # its own LM heads over the draft vocabulary: [Vd, H]
        assert weights["0.1.weight"].shape == (len(VOCAB), H)
    if name == "medusa-3-layers":
        assert back.hparams["num_layers"] == 3 and a["['w_rest']"].shape == (2, 2, H, H)
        assert {f"1.{j}.linear.weight" for j in range(3)} | {"1.3.weight"} <= set(weights)
    np.testing.assert_array_equal(spec_jax.draft_logits(target, heads, SEQ),
                                  spec_jax.draft_logits(target, back, SEQ))


def test_medusa_blocks_are_stacked_not_shared(imported):
    """Distinct ResBlocks import as distinct blocks; the published code's repeated module as equal
    ones, also where a deduplicating save kept block 0 alone."""
    own = spec_jax.load_draft(imported["medusa-2-layers"][3]).params
    assert own["w_rest"].shape == (1, 3, H, H) and not np.array_equal(own["w_rest"][0], own["w"])
    for name, n in (("medusa-official-pt", 3), ("medusa-official-dedup", 2)):
        p = spec_jax.load_draft(imported[name][3]).params
        assert p["w_rest"].shape == (n - 1, 2, H, H)
        for j in range(n - 1):
            np.testing.assert_array_equal(p["w_rest"][j], p["w"])
            np.testing.assert_array_equal(p["b_rest"][j], p["b"])


def test_existing_heads_unchanged_by_the_new_options(target):
    """Fresh MTP heads keep reading pre-norm features through the target's final norm."""
    from spec_jax.features import _target_features

    heads = spec_jax.init_draft(target, "mtp", scale=0.3)
    assert "out_norm" not in heads.params and "features" not in heads.hparams
    d = heads.drafter()
    assert d.features == "pre"
    h, _ = _target_features(target.params, np.asarray([SEQ], np.int32), target=target,
                            aux_layers=(), chunk=None)
    assert np.array_equal(np.asarray(d.target_feature(heads.params, target.params, CFG, h, None)),
                          np.asarray(h))


# ---------------------------------------------------------------- errors: one line, nothing written

def _one_line_and_nothing_written(excinfo, out):
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return msg


def test_wrong_format_is_one_line_and_writes_nothing(imported, target, tmp_path):
    src = imported["eagle3"][0]
    out = tmp_path / "out"
    with pytest.raises(SpecJaxError) as e:
        spec_jax.import_heads("eagle", src, target, out=out)
    msg = _one_line_and_nothing_written(e, out)
    assert "--format eagle3" in msg
    with pytest.raises(SpecJaxError) as e:
        spec_jax.import_heads("eagle2", src, target, out=out)
    assert "eagle2" in _one_line_and_nothing_written(e, out)


def test_missing_tensor_is_one_line_and_writes_nothing(target, tmp_path):
    sd, _ = make_medusa(tmp_path / "m")
    del sd["1.0.linear.bias"]
    save_file(sd, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(SpecJaxError) as e:
        spec_jax.import_heads("medusa", tmp_path / "m", target, out=out)
    msg = _one_line_and_nothing_written(e, out)
    assert "1.0.linear.bias" in msg and "lacks" in msg


def test_hidden_size_mismatch_names_tensor_and_both_shapes(target, tmp_path, capsys):
    from spec_jax.cli import main

    make_eagle(tmp_path / "e", vicuna=False, hidden=48)
    conf = json.loads((tmp_path / "e" / "config.json").read_text())
    del conf["hidden_size"]  # the shapes alone give it away
    (tmp_path / "e" / "config.json").write_text(json.dumps(conf))
    out = tmp_path / "out"
    with pytest.raises(SpecJaxError) as e:
        spec_jax.import_heads("eagle", tmp_path / "e", target, out=out)
    msg = _one_line_and_nothing_written(e, out)
    assert "fc.weight" in msg and "[48, 96]" in msg and "[32, 64]" in msg
    # the command line: the same one line, exit status 2
    tdir = tmp_path / "target"
    _save_target(target, tdir)
    rc = main(["import-heads", "--format", "eagle", "--src", str(tmp_path / "e"), "--target",
               str(tdir), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "fc.weight" in err
    assert not out.exists()


def test_cli_import_and_export(imported, target, tmp_path):
    from spec_jax.cli import main

    tdir = tmp_path / "target"
    _save_target(target, tdir)
    src = imported["eagle3"][0]
    assert main(["import-heads", "--format", "eagle3", "--src", str(src), "--target", str(tdir),
                 "--out", str(tmp_path / "h")]) == 0
    assert main(["export-heads", "--format", "eagle3", "--src", str(tmp_path / "h"), "--out",
                 str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "model.safetensors").is_file()
    assert main(["export-heads", "--format", "medusa", "--src", str(tmp_path / "h"), "--out",
                 str(tmp_path / "y")]) == 2
    assert not (tmp_path / "y").exists()


def test_pytorch_file_without_torch_names_the_extra(tmp_path, target, monkeypatch):
    make_eagle(tmp_path / "e", vicuna=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SpecJaxError, match=r"spec-jax\[torch\]"):
        spec_jax.import_heads("eagle", tmp_path / "e", target)


def test_pickle_beyond_tensors_is_refused(tmp_path, target):
    d = tmp_path / "e"
    d.mkdir()

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"fc.weight": torch.zeros(H, 2 * H), "x": Evil()}, d / "pytorch_model.bin")
    with pytest.raises(SpecJaxError, match="weights_only=True"):
        spec_jax.import_heads("eagle", d, target)


def _save_target(target, out):
    from spec_jax.io import atomic_dir, save_params

    with atomic_dir(out) as tmp:
        save_params(tmp / "params", target.params)
        (tmp / "spec_jax.json").write_text(json.dumps({"kind": "target",
                                                        "config": target.cfg.to_dict()}))
