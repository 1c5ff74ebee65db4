"""`spec-jax` command line: fetch, convert, import-heads, export-heads, generate, demo, distill,
datastore, train, bench.

Errors a user can fix print one line (`spec-jax: error: ...`) and exit with status 2
(`spec-jax --debug ...` shows their traceback instead). A --prompt whose bytes are not valid UTF-8
has them replaced by U+FFFD, with a warning.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spec_jax.errors import SpecJaxError

DEFAULT_MODEL = Path("checkpoints") / "smollm2-135m-instruct"
DEFAULT_DRAFTS = [Path("checkpoints") / f"smollm2-135m-instruct-{m}" for m in ("eagle", "eagle3")]


def _draft_arg(target, draft: str | None):
    if draft in (None, "none", "plain"):
        return None
    if draft in ("ngram", "mtp"):  # "mtp": the target's own MTP layers, converted beside it
        return draft
    if draft.startswith("random:"):
        import spec_jax

        return spec_jax.init_draft(target, draft.split(":", 1)[1])
    import spec_jax

    return spec_jax.load_draft(draft)


def cmd_fetch(a):
    from spec_jax.convert.fetch import fetch

    out = fetch(a.name, a.out, dtype=a.dtype, force=a.force)
    print(f"wrote {out}")


def cmd_convert(a):
    from spec_jax.convert.hf import convert_hf

    out = convert_hf(a.hf, a.out, dtype=a.dtype, force=a.force, mtp=not a.no_mtp)
    print(f"wrote {out}")


def _argv_text(text: str, flag: str) -> str:
    """A command-line string as text: bytes that are not valid UTF-8 (which Python keeps as lone
    surrogates, "surrogateescape") are replaced by U+FFFD, with a one-line warning, so the
    tokenizer never sees them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        fixed = os.fsencode(text).decode("utf-8", errors="replace")
        print(f"spec-jax: warning: {flag} is not valid UTF-8: its invalid bytes were replaced "
              "by U+FFFD", file=sys.stderr)
        return fixed


def cmd_import_heads(a):
    from spec_jax.convert.heads_io import import_heads

    heads = import_heads(a.format, a.src, a.target, out=a.out, force=a.force)
    print(f"wrote {a.out} ({heads.method} heads)")


def cmd_export_heads(a):
    from spec_jax.convert.heads_export import export_heads

    out = export_heads(a.format, a.src, a.out, target=a.target, force=a.force)
    print(f"wrote {out}")


def cmd_generate(a):
    import spec_jax

    if a.tree is not None and a.draft is None:  # the tree would be ignored: plain decoding
        raise SpecJaxError(f"--tree {a.tree} needs a drafter: pass --draft HEADS_DIR or --draft "
                           "ngram (without --draft, generate decodes plainly)")
    if a.stream and (a.json or a.show_accepted):
        other = "--json" if a.json else "--show-accepted"
        raise SpecJaxError(f"--stream prints the text as it comes: drop {other} (it prints the "
                           "text at the end)")
    prompt = _argv_text(a.prompt, "--prompt")
    mesh = None
    if a.mesh:  # over every host's devices where the hosts joined (`main`, before JAX started)
        from spec_jax.distributed import global_mesh, is_primary, parse_mesh

        mesh = global_mesh(*parse_mesh(a.mesh))
        if not is_primary():  # every host runs the same generation: the first prints it
            sys.stdout = open(os.devnull, "w")
    target = spec_jax.load_target(a.model, mesh=mesh)
    draft = _draft_arg(target, a.draft)
    ds = spec_jax.load_datastore(a.datastore) if a.datastore else None
    options = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                   seed=a.seed, chat=not a.no_chat, draft=draft, tree=a.tree,
                   attn_impl=a.attn_impl, datastore=ds, fallback=not a.no_fallback)
    if a.stream:
        pieces = spec_jax.stream(target, prompt, **options)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        r = pieces.result
    else:
        r = spec_jax.generate(target, prompt, **options)
    if a.json:
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "stats": r.stats}))
    else:
        if a.show_accepted:
            colour = sys.stdout.isatty() or bool(os.environ.get("FORCE_COLOR"))
            print(_coloured_steps(r, colour=colour))
        else:
            print("" if a.stream else r.text)
        s = r.stats
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, "
              f"{s['mean_accepted']:.2f} tokens/target call, finish={s['finish_reason']}]",
              file=sys.stderr)
    if r.stats.get("error"):
        print(f"spec-jax: error: {r.stats['error']}", file=sys.stderr)
        return 2


ACCEPTED_COLOUR, RESET = "\033[32m", "\033[0m"  # accepted draft tokens: green


def _coloured_steps(r, colour: bool = True) -> str:
    """The text with each step's accepted draft tokens in green (in [brackets] where `colour` is
    off: output to a file or a pipe)."""
    parts = []
    for accepted, own in r.steps():
        if accepted:
            parts.append(f"{ACCEPTED_COLOUR}{accepted}{RESET}" if colour else f"[{accepted}]")
        parts.append(own)
    return "".join(parts)


def cmd_demo(a):
    import spec_jax
    from spec_jax import demo
    from spec_jax.convert.fetch import fetch

    model = Path(a.model)
    if not (model / "spec_jax.json").is_file():
        print(f"fetching SmolLM2-135M-Instruct into {model} ...", flush=True)
        fetch("smollm2-135m-instruct", model, force=model.exists())
    target = spec_jax.load_target(model)
    demo.run(target, [Path(d) for d in (a.draft or DEFAULT_DRAFTS)], a.max_new_tokens)


def cmd_distill(a):
    import spec_jax
    from spec_jax.train.distill import distill

    target = spec_jax.load_target(a.model)
    distill(target, a.data, a.out, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
            batch_size=a.batch_size, temperature=a.temperature, seed=a.seed, mix=a.mix, start=a.start)


def cmd_datastore(a):
    import spec_jax
    from spec_jax.heads.datastore import datastore_from_distill, save_datastore

    if Path(a.out).exists() and not a.force:  # said before the build, not after it
        raise SpecJaxError(f"{a.out} already exists: choose another --out or pass --force to replace it")
    target = spec_jax.load_target(a.model)
    ds = datastore_from_distill(target, a.data, max_ngram=a.max_ngram, min_ngram=a.min_ngram,
                                depth=a.depth)
    n = len(ds.tables()["ds_h1"])  # built once here, so a bad corpus fails before anything is written
    out = save_datastore(ds, a.out, force=a.force)
    print(f"wrote {out}: {int((ds.tokens >= 0).sum())} tokens, {n} n-grams")


def cmd_train(a):
    from spec_jax.train.loop import train_cli

    train_cli(a)


def cmd_bench(a):
    from spec_jax.bench import bench_cli

    bench_cli(a)


def cmd_plan(a):
    import json
    import os

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu: no slice to look for
    from spec_jax.config import ModelConfig
    from spec_jax.plan import plan

    path = Path(a.config)
    path = path / "config.json" if path.is_dir() else path
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecJaxError(f"cannot read the config {path}: {e}") from None
    cfg = ModelConfig.from_hf_dict(hf, dtype=a.dtype)
    mesh = dict(kv.split("=") for kv in a.mesh.split(",")) if a.mesh else {}
    bad = set(mesh) - {"data", "model"}
    if bad or not all(v.isdigit() for v in mesh.values()):
        raise SpecJaxError(f"--mesh {a.mesh!r}: write data=D,model=M")
    r = plan(cfg, a.topology, int(mesh.get("data", 1)),
             int(mesh["model"]) if "model" in mesh else None, a.batch, a.context,
             None if a.draft in (None, "none") else a.draft, a.tree)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    gib = 2 ** 30
    print(f"{a.topology}, mesh data={r['mesh']['data']} model={r['mesh']['model']}, batch "
          f"{a.batch}, context {a.context}, {cfg.dtype}")
    print(f"per chip: weights {r['weight_bytes_per_chip'] / gib:.2f} GiB, KV cache "
          f"{r['cache_bytes_per_chip'] / gib:.2f} GiB, in all {r['per_chip_bytes'] / gib:.2f} GiB "
          f"of {r['hbm_bytes'] / gib:.1f} GiB HBM: {'fits' if r['fits'] else 'does not fit'}"
          + (" (compiled for the topology)" if r["compiled"] else " (not compiled)"))
    if not r["fits"]:
        print("would fit: " + "; ".join(r["would_fit"]))
    if r["plain_step_seconds"]:
        print(f"plain step: {r['plain_step_seconds'] * 1e3:.2f} ms ({r['step_seconds_kind']})")
    if r.get("tree_step_seconds"):
        print(f"{a.draft} tree step ({r['tree_tokens']} tokens): "
              f"{r['tree_step_seconds'] * 1e3:.2f} ms, "
              f"{r['tree_step_seconds'] / r['plain_step_seconds']:.2f}x a plain step")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec-jax", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error instead of its one-line message")
    sub = p.add_subparsers(dest="cmd", required=True)

    f = sub.add_parser("fetch", help="download and convert a known model (smollm2-135m-instruct)")
    f.add_argument("name")
    f.add_argument("--out", default=None)
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    f.add_argument("--force", action="store_true", help="replace an existing output")
    f.set_defaults(fn=cmd_fetch)

    c = sub.add_parser("convert", help="convert a Hugging Face directory to an Orbax checkpoint")
    c.add_argument("--hf", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--force", action="store_true")
    c.add_argument("--no-mtp", action="store_true", help="leave out the MTP layers a checkpoint "
                   "ships (kept by default as OUT/mtp/ heads, for generate(draft='mtp'))")
    c.set_defaults(fn=cmd_convert)

    ih = sub.add_parser("import-heads", help="published draft heads (EAGLE, EAGLE-3, Medusa, "
                        "MTP layers) as spec_jax heads for a target")
    ih.add_argument("--format", required=True, choices=["eagle", "eagle3", "medusa", "mtp"])
    ih.add_argument("--src", required=True, help="the downloaded heads (for mtp: the target's "
                    "Hugging Face checkpoint holding its MTP layers)")
    ih.add_argument("--target", required=True, help="the spec_jax target checkpoint")
    ih.add_argument("--out", required=True)
    ih.add_argument("--force", action="store_true", help="replace an existing output")
    ih.set_defaults(fn=cmd_import_heads)

    eh = sub.add_parser("export-heads", help="spec_jax heads in a published layout (safetensors "
                        "+ config.json) for other engines")
    eh.add_argument("--format", required=True, choices=["eagle", "eagle3", "medusa"])
    eh.add_argument("--src", required=True, help="spec_jax heads directory")
    eh.add_argument("--out", required=True)
    eh.add_argument("--target", default=None, help="the target checkpoint (needed for heads not "
                    "imported from a published file: their config.json, Medusa's LM heads)")
    eh.add_argument("--force", action="store_true", help="replace an existing output")
    eh.set_defaults(fn=cmd_export_heads)

    g = sub.add_parser("generate", help="generate text, plainly or speculatively")
    g.add_argument("--model", default=str(DEFAULT_MODEL))
    g.add_argument("--prompt", required=True)
    g.add_argument("--draft", default=None,
                   help="heads directory, 'ngram', 'random:METHOD' (untrained), or omit for plain")
    g.add_argument("--tree", default=None,
                   help="auto (size the tree for this machine: measured once, then cached) | "
                        "mc_sim_7b_63 | medusa | chain:N | dynamic:K,D,N | JSON list of paths, "
                        "each optionally +ngram:N (graft an N-token n-gram chain onto it) and "
                        "+ds:N (graft N tokens from --datastore); a dynamic tree's grafts "
                        "+ranked compete for its N tokens (dynamic:8,5,32+ngram:24+ds:8+ranked); "
                        "omitted: the sized tree if there is one, else the method's default")
    g.add_argument("--datastore", default=None,
                   help="a folder written by `spec-jax datastore`: draft from the target's own "
                        "earlier output too (+ds:N in --tree, 8 tokens if it does not say)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--attn-impl", default="auto", choices=["auto", "xla", "cpu", "pallas", "pallas_interpret"])
    g.add_argument("--mesh", default=None,
                   help="decode on a mesh of devices: data=D,model=M (either may be left out) or "
                        "auto (model over each host's devices, data over the hosts); run on every "
                        "host of a TPU slice with SPEC_JAX_DISTRIBUTED=1 (docs/sharding.md)")
    g.add_argument("--no-fallback", action="store_true",
                   help="with a sized tree, speculate every step (by default, where the sizing "
                        "measured that it pays, a request takes plain steps while its trees accept "
                        "fewer tokens than they cost)")
    g.add_argument("--json", action="store_true")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--show-accepted", action="store_true",
                   help="print the text with the draft tokens the target accepted in green (in "
                        "[brackets] when the output is not a terminal)")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="fetch SmolLM2 if needed, then show where speculation pays: "
                                    "plain, n-gram and trained heads on chat, code and rewriting")
    d.add_argument("--model", default=str(DEFAULT_MODEL))
    d.add_argument("--draft", action="append",
                   help="a head folder (repeatable; default: the shipped EAGLE and EAGLE-3 heads)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("distill", help="self-distillation data: the target answers train prompts")
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    s.add_argument("--data", required=True,
                   help="a folder of prompt files, or `self`: the target writes the prompts too "
                        "(sampled after its chat template's user-turn header)")
    s.add_argument("--out", required=True)
    s.add_argument("--num-prompts", type=int, default=1000)
    s.add_argument("--max-new-tokens", type=int, default=160)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--start", type=int, default=0,
                   help="answer prompts from this index of the prompt order on (a fresh set that "
                        "continues an earlier one)")
    s.add_argument("--mix", choices=("proportional", "balanced"), default="proportional",
                   help="proportional: prompts drawn in proportion to each file's size; balanced: "
                        "one prompt from each file in turn (chat-like files are small)")
    s.set_defaults(fn=cmd_distill)

    ds = sub.add_parser("datastore", help="a datastore for +ds:N drafting from distilled data")
    ds.add_argument("--model", default=str(DEFAULT_MODEL))
    ds.add_argument("--data", required=True, nargs="+", help="folders written by `spec-jax distill`")
    ds.add_argument("--out", required=True)
    ds.add_argument("--max-ngram", type=int, default=8)
    ds.add_argument("--min-ngram", type=int, default=2)
    ds.add_argument("--depth", type=int, default=8, help="longest continuation it can draft")
    ds.add_argument("--force", action="store_true", help="replace an existing output")
    ds.set_defaults(fn=cmd_datastore)

    t = sub.add_parser("train", help="train draft heads on self-distillation data")
    t.add_argument("--model", default=str(DEFAULT_MODEL))
    t.add_argument("--method", required=True, choices=["eagle", "eagle3", "medusa", "mtp"])
    t.add_argument("--data", required=True, nargs="+",
                   help="folders written by `spec-jax distill` (the end of the last is held out)")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="propose from the N most frequent response tokens (0: full vocabulary)")
    t.add_argument("--labels", choices=["hard", "soft"], default="hard",
                   help="cross-entropy on the data's tokens, or on the target's own distribution "
                        "(EAGLE's loss; eagle, eagle3, mtp)")
    t.add_argument("--init", help="heads to fine-tune (kept unchanged) instead of random ones")
    t.add_argument("--layers", type=int, default=1,
                   help="eagle: decoder layers of the head (1: the paper's); an --init head with "
                        "fewer is grown by identity layers")
    t.add_argument("--own-lm-heads", action="store_true",
                   help="medusa: an LM head of its own per head (Medusa-1's; more accurate, K "
                        "reads a draft step instead of one); --init heads without them start from "
                        "copies of the target's")
    t.add_argument("--eagle-features", choices=["pre", "post"],
                   help="eagle: the target's final hidden states after its final norm (the "
                        "reference's; the default for fresh heads) or before it; an --init head "
                        "keeps its own")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--force", action="store_true")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_train)

    pl = sub.add_parser("plan", help="compile for a TPU topology (no TPU needed): memory per chip, "
                                     "whether it fits, step time bounds")
    pl.add_argument("--config", required=True, help="a Hugging Face config.json or its folder")
    pl.add_argument("--topology", default="v5e:2x2", help="e.g. v5e:2x2, v6e:2x4, v5p:2x2x2")
    pl.add_argument("--mesh", default=None, help="data=D,model=M (default: every chip on model)")
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--context", type=int, default=8192)
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    pl.add_argument("--draft", default=None, help="eagle | eagle3 | medusa | mtp (fresh heads' shapes)")
    pl.add_argument("--tree", default=None, help="the heads' tree, e.g. dynamic:8,6,32")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    b = sub.add_parser("bench", help="measure plain vs speculative decoding on prompt sets")
    b.add_argument("--model", default=str(DEFAULT_MODEL))
    b.add_argument("--layers", default="auto",
                   choices=["auto", "scan", "unrolled", "packed", "packed_f32"],
                   help="the target's layout (load_target's layers=): packed_f32 streams float32 "
                        "weights even where exact 4/8-bit codes would do")
    b.add_argument("--drafts", nargs="*", default=["ngram"],
                   help="ngram or a heads directory, each optionally @TREE; @auto sizes it for "
                        "this machine first (ngram@auto: its chain length, or plain decoding)")
    b.add_argument("--prompts", nargs="+", default=None,
                   help="prompt files (default: the shipped MT-bench questions, spec_jax/prompts)")
    b.add_argument("--limit", type=int, default=10,
                   help="prompts per file, taken in turn from its categories")
    b.add_argument("--turns", choices=("all", "first"), default="all",
                   help="multi-turn prompts (MT-bench): every turn, each asked after the target's "
                        "answers to the turns before it, as EAGLE and Medusa evaluate (the "
                        "default); or the first turn alone")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--out", default="bench_out")
    b.add_argument("--datastore", default=None,
                   help="datastore folder for drafts whose tree has +ds:N")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the default); > 0: every method and peer samples, and "
                        "HEADS@auto is sized for sampling at this temperature and --top-p")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    b.add_argument("--calibrate", action="store_true",
                   help="size the tree of every heads afresh (HEADS@auto sizes once, cached) and "
                        "print and plot the curve it was chosen from")
    b.add_argument("--calibrate-on", metavar="PROMPTS",
                   help="size trees on 8 prompts of this file (spread over its categories, none "
                        "that the bench measures) instead of the built-in calibration prompts; "
                        "implies --calibrate; the choice is cached for tree='auto' as any sizing is")
    b.add_argument("--fallback", choices=("on", "off", "both"), default="on",
                   help="sized (@auto) drafters: with plain steps where their trees do not pay "
                        "(as generate runs them), without, or both as separate rows")
    b.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip transformers' generate (greedy, prompt lookup and assisted "
                        "generation, run on each prompt after spec_jax's methods)")
    b.add_argument("--profile", action="store_true",
                   help="after the runs, profile each method on the first prompt (CPU) and "
                        "print the shares of a step in draft, verify and bookkeeping")
    b.add_argument("--assistant-layers", type=int, default=4, metavar="N",
                   help="assisted generation's assistant: the target's first N layers, an "
                        "untrained early exit (no smaller model with its tokenizer is at hand); "
                        "0 leaves that peer out (default 4)")
    b.add_argument("--batch-sizes", default=None, metavar="B,B,...",
                   help="instead of the per-prompt table: total new tokens/s of plain decoding and "
                        "each drafter over the same prompts decoded B at a time, per batch size "
                        "(e.g. 1,4,16); drafters without @TREE run tree 'auto', sized per batch "
                        "size on first use (minutes each), then cached; no transformers peers")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "generate" and args.mesh:  # the hosts join before anything starts JAX
        from spec_jax.distributed import initialize

        try:
            initialize()
        except SpecJaxError as e:
            if args.debug:
                raise
            print(f"spec-jax: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    if argv is None and args.cmd not in ("fetch", "convert", "import-heads", "export-heads"):
        # a real command line: compiled programs go to disk for the next run (tests pass argv
        # and keep their process's JAX settings as they are)
        from spec_jax._xla import enable_compilation_cache

        enable_compilation_cache()
    try:
        rc = args.fn(args)  # a command returns 2 where its output is incomplete
    except SpecJaxError as e:
        if args.debug:
            raise
        print(f"spec-jax: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spec-jax: interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
