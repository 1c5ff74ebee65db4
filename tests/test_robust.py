"""Reliability: every bad input is a one-line SpecJaxError (a one-line CLI error with exit status
2), nothing silently wrong, damaged files detected, no half-written or lost outputs."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_config

import spec_jax
from spec_jax.errors import SpecJaxError
from spec_jax.heads.registry import save_draft
from spec_jax.io import atomic_dir, save_params
from spec_jax.target import Target

SMOLLM2 = ROOT / "checkpoints" / "smollm2-135m-instruct"


def save_target(path: Path, params, cfg, tokenizer_from: Path | None = None) -> Path:
    """A target checkpoint as `spec-jax convert` writes it (params/ + spec_jax.json)."""
    path.mkdir(parents=True)
    save_params(path / "params", params)
    (path / "spec_jax.json").write_text(json.dumps({"kind": "target", "config": cfg.to_dict()}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer_from is not None and (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def cli(*args, env=None):
    """The real entry point in a fresh process: (exit status, stdout, stderr)."""
    run = subprocess.run([sys.executable, "-m", "spec_jax.cli", *args], capture_output=True,
                         cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)
    return run.returncode, run.stdout.decode(errors="replace"), run.stderr.decode(errors="replace")


def one_line_error(rc, err, needle):
    """Exit status 2 and exactly one `spec-jax: error:` line holding `needle`, no traceback."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("spec-jax: error:")]
    assert len(lines) == 1 and needle in lines[0], err


def single_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_target):
    return save_target(tmp_path_factory.mktemp("ck") / "ok", tiny_target.params, tiny_target.cfg)


# 1a: non-finite weights


def test_nonfinite_target_weights_are_refused_at_load(tmp_path, tiny_target):
    params = dict(tiny_target.params)
    params["layers"] = dict(params["layers"])
    params["layers"]["w_up"] = params["layers"]["w_up"].at[1, 3, 5].set(jnp.inf)
    ck = save_target(tmp_path / "nan", params, tiny_target.cfg)
    with pytest.raises(SpecJaxError, match=r"non-finite weights .* 'layers/w_up' .*nan") as e:
        spec_jax.load_target(ck, layers="scan")
    single_line(e)


def test_nonfinite_head_weights_are_refused_at_load(tmp_path, tiny_target):
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    heads.params["fc_w"] = heads.params["fc_w"].at[0, 0].set(jnp.nan)
    out = save_draft(heads, tmp_path / "heads")
    with pytest.raises(SpecJaxError, match=r"non-finite weights .* 'fc_w' of the eagle heads at "
                                           r".*heads") as e:
        spec_jax.load_draft(out)
    single_line(e)


# 1b: metadata vs weights


@pytest.mark.parametrize("field,value,needle", [
    ("num_kv_heads", 4, "num_kv_heads*head_dim=32"),
    ("intermediate_size", 80, "intermediate_size=80"),
    ("vocab_size", 65, "vocab_size=65"),
    ("hidden_size", 48, "hidden_size=48"),
    ("num_layers", 3, "num_layers=3"),
    ("num_heads", 2, "num_heads*head_dim=16"),
])
def test_metadata_that_disagrees_with_the_weights_names_the_field(tmp_path, saved, field, value,
                                                                   needle):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    meta = json.loads((ck / "spec_jax.json").read_text())
    meta["config"][field] = value
    (ck / "spec_jax.json").write_text(json.dumps(meta))
    with pytest.raises(SpecJaxError, match="disagrees with the weights") as e:
        spec_jax.load_target(ck, layers="scan")
    assert needle in single_line(e)


def test_head_metadata_that_disagrees_with_the_weights_is_refused(tmp_path, tiny_target):
    out = save_draft(spec_jax.init_draft(tiny_target, "eagle", seed=1), tmp_path / "h")
    meta = json.loads((out / "spec_jax.json").read_text())
    meta["target"]["hidden_size"] = 48
    (out / "spec_jax.json").write_text(json.dumps(meta))
    with pytest.raises(SpecJaxError, match=r"target.hidden_size=48 disagrees with the weights: "
                                           r"layer/w(o|_down) has shape") as e:
        spec_jax.load_draft(out)
    single_line(e)


# 1c: the Python API's inputs


@pytest.mark.parametrize("prompt,needle", [
    (b"hello", "not a bytes"), ([1.0, 2.0], "not float"), ([True, 2], "not bool"),
    ([-1, 2], "token id -1 is out of range"), ([1, 64], "token id 64 is out of range"),
    ([[1, 2]], "not list"), (None, "not a NoneType"), ({"role": "user"}, "not a dict"),
    (5, "not a int"), ([1, None], "not NoneType"), (np.array([1.0, 2.0]), "1-D of integer"),
    (np.array([[1, 2]]), "1-D of integer"), ([], "empty prompt"),
])
def test_bad_prompts_are_one_line_errors(tiny_target, prompt, needle):
    with pytest.raises(SpecJaxError) as e:
        spec_jax.generate(tiny_target, prompt, 2)
    assert needle in single_line(e)


def test_token_ids_of_numpy_types_are_accepted(tiny_target):
    want = spec_jax.generate(tiny_target, [1, 2, 3], 3).token_ids
    assert spec_jax.generate(tiny_target, np.array([1, 2, 3], np.int64), 3).token_ids == want
    assert spec_jax.generate(tiny_target, (np.int32(1), 2, np.uint8(3)), 3).token_ids == want


@pytest.mark.parametrize("kw,needle", [
    ({"accept_rule": "exactly"}, "unknown accept_rule 'exactly': choose one of exact, broken"),
    ({"attn_impl": "flash"}, "unknown attn_impl 'flash': choose one of auto, xla"),
])
def test_unknown_accept_rule_and_attn_impl_list_the_choices(tiny_target, kw, needle):
    with pytest.raises(SpecJaxError) as e:
        spec_jax.generate(tiny_target, [1, 2], 2, **kw)
    assert needle in single_line(e)


# 1d: non-finite logits in the loop


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_row_with_nonfinite_logits_stops_with_an_error(tiny_target, draft):
    good = spec_jax.generate(tiny_target, [1, 2, 3], 10).token_ids
    params = dict(tiny_target.params)
    bad_token = good[3]  # its embedding turns NaN: the logits after it are NaN
    params["embed"] = params["embed"].at[bad_token].set(jnp.nan)
    broken = Target(cfg=tiny_target.cfg, params=params)
    rows = spec_jax.generate_batch(broken, [[1, 2, 3], [4, bad_token, 6]], 10, draft=draft)
    assert rows[0].token_ids == good[:4]  # the tokens before it, then nothing (not token 0)
    assert rows[1].token_ids == []
    for r in rows:
        assert r.stats["finish_reason"] == "error"
        assert "non-finite" in r.stats["error"]
    fine = spec_jax.generate_batch(broken, [[4, 5, 6]], 4, draft=draft)[0]
    assert fine.stats["finish_reason"] == "length" and "error" not in fine.stats


# 2a: damaged checkpoints


def _truncate_data(ck):
    files = [f for f in (ck / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


@pytest.mark.parametrize("damage,needle", [
    (lambda ck: shutil.rmtree(ck / "params"), "its params/ folder is missing"),
    (lambda ck: (ck / "params" / "_METADATA").unlink(), "cannot be read"),
    (_truncate_data, "cannot be read"),
    (lambda ck: (ck / "spec_jax.json").write_text(""), "spec_jax.json is not valid JSON"),
    (lambda ck: (ck / "spec_jax.json").write_text("{\"kind\": "), "spec_jax.json is not valid JSON"),
    (lambda ck: (ck / "spec_jax.json").write_text("[]"), "holds a list"),
    (lambda ck: (ck / "spec_jax.json").unlink(), "spec_jax.json is missing"),
    (lambda ck: (ck / "spec_jax.json").write_text('{"kind": "target"}'), "lacks 'config'"),
    (lambda ck: _edit_config(ck, bogus=1), "has unknown bogus"),
    (lambda ck: _edit_config(ck, vocab_size=None), "lacks vocab_size"),
    (lambda ck: _edit_config(ck, hidden_size="32"), "hidden_size='32', not a positive integer"),
])
def test_damaged_checkpoint_is_one_line(tmp_path, saved, damage, needle):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    damage(ck)
    with pytest.raises(SpecJaxError, match=f"checkpoint {ck} is damaged: ") as e:
        spec_jax.load_target(ck, layers="scan")
    msg = single_line(e)
    assert needle in msg and msg.endswith("re-run `spec-jax convert` or `spec-jax fetch`")


def _edit_config(ck, **kw):
    meta = json.loads((ck / "spec_jax.json").read_text())
    for k, v in kw.items():
        if v is None:
            del meta["config"][k]
        else:
            meta["config"][k] = v
    (ck / "spec_jax.json").write_text(json.dumps(meta))


def test_cli_damaged_checkpoint_one_line_and_debug_traceback(tmp_path, saved):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    (ck / "params" / "_METADATA").unlink()
    rc, _, err = cli("generate", "--model", str(ck), "--prompt", "hi", "--max-new-tokens", "2")
    one_line_error(rc, err, f"checkpoint {ck} is damaged")
    rc, _, err = cli("--debug", "generate", "--model", str(ck), "--prompt", "hi")
    assert rc != 0 and "Traceback" in err and "SpecJaxError" in err


# 2b: a --prompt that is not UTF-8


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason="needs SmolLM2's tokenizer")
def test_cli_prompt_with_invalid_utf8_is_replaced_with_a_warning(tmp_path):
    cfg = tiny_config(vocab_size=49152)
    ck = save_target(tmp_path / "tok", spec_jax.random_target(cfg, scale=0.3).params, cfg,
                     tokenizer_from=SMOLLM2)
    rc, out, err = cli("generate", "--model", str(ck), "--prompt", b"caf\xe9 \xff ok",
                       "--max-new-tokens", "3", "--no-chat", "--json")
    assert rc == 0, err
    assert "Traceback" not in err and "--prompt is not valid UTF-8" in err
    assert json.loads(out.splitlines()[-1])["stats"]["prompt_tokens"] > 0


# 2c: spec-jax convert


def _hf_dir(path: Path, **config) -> Path:
    """A tiny Llama checkpoint in Hugging Face's layout, written without PyTorch."""
    from safetensors.numpy import save_file

    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=40, hidden_size=16,
               intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)
    h, i, v, hd = 16, 24, 40, 4
    rng = np.random.default_rng(0)
    w = lambda *s: rng.normal(0, 0.1, s).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": w(h), "lm_head.weight": w(v, h)}
    for n in range(2):
        p = f"model.layers.{n}."
        t.update({p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
                  p + "self_attn.q_proj.weight": w(4 * hd, h), p + "self_attn.k_proj.weight": w(2 * hd, h),
                  p + "self_attn.v_proj.weight": w(2 * hd, h), p + "self_attn.o_proj.weight": w(h, 4 * hd),
                  p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                  p + "mlp.down_proj.weight": w(h, i)})
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return path


@pytest.mark.parametrize("edit,needle", [
    ({"num_hidden_layers": 3}, "num_hidden_layers=3 but the tensors hold 2 layers"),
    ({"num_hidden_layers": 1}, "num_hidden_layers=1 but the tensors hold 2 layers"),
    ({"vocab_size": 41}, "model.embed_tokens.weight should have shape (41, 16)"),
    ({"hidden_size": 20}, "model.embed_tokens.weight should have shape (40, 20)"),
    ({"num_attention_heads": 2}, "from num_key_value_heads/head_dim"),
    ({"intermediate_size": 32}, "(from intermediate_size)"),
    ("{not json", "config.json is not valid JSON"),
    ({"hidden_size": None}, "lacks or mistypes a field"),
    ("truncate", "cannot be read"),
    ("drop", "lacks tensor model.layers.1.mlp.up_proj.weight"),
])
def test_convert_bad_inputs_are_one_line_and_write_nothing(tmp_path, edit, needle):
    from spec_jax.convert.hf import convert_hf

    hf = _hf_dir(tmp_path / "hf")
    if edit == "truncate":
        f = hf / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-500])
    elif edit == "drop":
        from safetensors.numpy import load_file, save_file

        t = load_file(str(hf / "model.safetensors"))
        del t["model.layers.1.mlp.up_proj.weight"]
        save_file(t, str(hf / "model.safetensors"))
    elif isinstance(edit, str):
        (hf / "config.json").write_text(edit)
    else:
        cfg = json.loads((hf / "config.json").read_text())
        cfg.update({k: v for k, v in edit.items() if v is not None})
        for k in [k for k, v in edit.items() if v is None]:
            del cfg[k]
        (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecJaxError) as e:
        convert_hf(hf, tmp_path / "out")
    assert needle in single_line(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no temp folder


def test_cli_convert_errors_through_the_entry_point(tmp_path):
    hf = _hf_dir(tmp_path / "hf", vocab_size=41)
    rc, _, err = cli("convert", "--hf", str(hf), "--out", str(tmp_path / "out"))
    one_line_error(rc, err, "config.json disagrees with the tensors")
    hf2 = _hf_dir(tmp_path / "hf2")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode: a file stands in for the folder
            locked.chmod(0o755)
            locked.rmdir()
            locked.write_text("a file, not a folder")
        rc, _, err = cli("convert", "--hf", str(hf2), "--out", str(locked / "out"))
        one_line_error(rc, err, f"cannot write {locked / 'out'}")
    finally:
        if locked.is_dir():
            locked.chmod(0o755)
    rc, out, err = cli("convert", "--hf", str(hf2), "--out", str(tmp_path / "good"))
    assert rc == 0, err
    spec_jax.load_target(tmp_path / "good", layers="scan")


# 3: temporary folders, --force, the kernel cache


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_atomic_dir_cleans_only_stale_temporary_folders(tmp_path):
    out = tmp_path / "ck"
    dead, alive = _dead_pid(), os.getppid()
    stale = tmp_path / f".ck.tmp-{dead}-abc"
    live = tmp_path / f".ck.tmp-{alive}-def"  # another writer, still running
    legacy_old, legacy_new = tmp_path / ".ck.tmp-x_old", tmp_path / ".ck.tmp-y_new"  # no PID
    for d in (stale, live, legacy_old, legacy_new):
        d.mkdir()
        (d / "half-written").write_text("x")
    os.utime(legacy_old, (time.time() - 7 * 3600,) * 2)
    with atomic_dir(out) as tmp:
        (tmp / "f").write_text("new")
    assert (out / "f").read_text() == "new"
    assert not stale.exists() and not legacy_old.exists()
    assert live.exists() and legacy_new.exists()


def test_force_killed_between_renames_is_restored(tmp_path):
    out = tmp_path / "ck"
    # what `atomic_dir(force=True)` leaves when killed after moving the old output aside
    aside = tmp_path / f".ck.old-{_dead_pid()}-abc"
    aside.mkdir()
    (aside / "x").mkdir()
    (aside / "x" / "f").write_text("old")
    with pytest.raises(SpecJaxError, match="already exists"):
        with atomic_dir(out):
            pass
    assert (out / "f").read_text() == "old" and not aside.exists()
    with atomic_dir(out, force=True) as tmp:
        (tmp / "f").write_text("new")
    assert (out / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_truncated_kernel_library_is_rebuilt(tmp_path):
    """A cached CPU-kernel library cut short (a full disk, a killed copy) once crashed the process
    that loaded it ("Bus error"); its recorded hash now sends it to be rebuilt."""
    if shutil.which("g++") is None and not os.environ.get("CXX"):
        pytest.skip("needs a C++ compiler")
    from pallas_kernels.cpu import build

    probe = ("from pallas_kernels.cpu import build; import jax; lib = build._load(); "
             "print(lib); assert lib and build._intact(__import__('pathlib').Path(lib))")
    env = {**os.environ, "SPEC_JAX_CACHE": str(tmp_path), "SPEC_JAX_CPU_KERNELS": "1"}
    cmd = [sys.executable, "-c", probe]
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    name = f"cpu_kernels-{build._build_key(build._command(compiler))}.so"
    built = build._cache_dir() / name  # this process's cache: a library built here before
    lib = tmp_path / "kernels" / name
    if built.is_file():
        lib.parent.mkdir()
        shutil.copy(built, lib)
    else:
        first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert first.returncode == 0, first.stderr
    size = lib.stat().st_size
    lib.write_bytes(lib.read_bytes()[: size // 2])  # as loaded before: "Bus error" (status 135)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[-1] == str(lib) and "unavailable" not in again.stderr
    assert build._intact(lib) and lib.stat().st_size > size // 2


def test_a_packed_cache_write_killed_midway_leaves_no_orphan(tmp_path):
    """The temporary of a packed-weight cache write whose process died is removed by the next
    write of that cache; a live writer's is kept."""
    import os

    from spec_jax.target import _drop_orphans

    file = tmp_path / "abc.npz"
    dead = tmp_path / "abc.tmp999999999.npz"  # no such process
    live = tmp_path / f"abc.tmp{os.getppid()}.npz"
    for f in (dead, live):
        f.write_bytes(b"half a file")
    _drop_orphans(file)
    assert not dead.exists() and live.exists()


def test_heads_made_for_a_float32_target_serve_its_bfloat16_load():
    import dataclasses

    import jax
    import jax.numpy as jnp

    from tests.conftest import tiny_config

    t32 = spec_jax.random_target(tiny_config(), seed=3, scale=0.3)
    t16 = spec_jax.Target(cfg=dataclasses.replace(t32.cfg, dtype="bfloat16"),
                          params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), t32.params))
    heads = spec_jax.init_draft(t32, "eagle")
    assert t16.fingerprint() != t32.fingerprint()  # the sizing keys each dtype on its own
    heads.check_target(t16)  # but the heads are the same target's
    other = spec_jax.random_target(tiny_config(), seed=4, scale=0.3)
    with pytest.raises(SpecJaxError, match="weights differ"):
        heads.check_target(other)
    legacy = dict(heads.target_info)
    legacy.pop("weights")  # heads saved before the dtype-free fingerprint: the exact one decides
    heads.target_info = legacy
    heads.check_target(t32)
    with pytest.raises(SpecJaxError, match="fingerprint differ"):
        heads.check_target(t16)


def test_float32_checkpoints_serve_in_bfloat16_on_accelerators_only(monkeypatch):
    from types import SimpleNamespace

    import spec_jax.target as tgt
    from tests.conftest import tiny_config

    cfg = tiny_config()
    assert tgt.serving_dtype(cfg) is None  # the CPU: as stored
    for platform, want in [("gpu", "bfloat16"), ("tpu", "bfloat16"), ("cpu", None)]:
        monkeypatch.setattr(tgt.jax, "local_devices", lambda p=platform: [SimpleNamespace(platform=p)])
        assert tgt.serving_dtype(cfg) == want
        assert tgt.serving_dtype(tiny_config(dtype="bfloat16")) is None  # already bfloat16
