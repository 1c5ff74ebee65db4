"""The shipped SmolLM2 heads exported in their published layouts and imported back, decoded with.

For each of checkpoints/smollm2-135m-instruct-{eagle,eagle3,medusa}: `export_heads` to a
temporary folder, `import_heads` from it, then greedy decoding of the first MT-bench prompts
(their first turns) with the original and with the re-imported heads on the same tree: the
heads' own, written out (a dynamic tree's settings, a static tree's paths) so that no sizing
cache or fallback to plain steps, which depend on timings, is involved; or --tree. Prints per
prompt tau (mean accepted tokens per target call) of both and whether their tokens equal each
other and plain decoding's, then per heads the tau over all prompts and the tokens of the first
prompt. Export then import is bit for bit, so both columns should agree.

    python scripts/heads_roundtrip.py [--prompts 4] [--max-new-tokens 64] [--tree auto]
"""
import argparse
import json
import tempfile
from pathlib import Path

import spec_jax
from spec_jax.data import prompt_set

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("eagle", "eagle3", "medusa")


def tau(results) -> float:
    """Accepted tokens per verify call over several generations (the prefill's token left out)."""
    toks = sum(r.stats["new_tokens"] - 1 for r in results)
    calls = sum(r.stats["target_calls"] - 1 for r in results)
    return toks / calls if calls else 0.0


def own_tree(heads):
    """The heads' own tree, as an explicit tree option."""
    d = heads.drafter()
    if heads.method == "medusa":
        return [list(p) for p in d.tree.paths]
    hp = heads.hparams
    return f"dynamic:{hp['top_k']},{hp['depth']},{hp['total_tokens']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default=None, help="tree option (default: the heads' own)")
    a = ap.parse_args()

    if not (Path(a.target) / "spec_jax.json").is_file():
        from spec_jax.convert.fetch import fetch

        fetch("smollm2-135m-instruct", Path(a.target), force=Path(a.target).exists())
    target = spec_jax.load_target(a.target, layers="scan")  # compiles faster; the same tokens
    lines = prompt_set("mt_bench").read_text().splitlines()[: a.prompts]
    prompts = [json.loads(line)["turns"][0] for line in lines]
    gen = dict(max_new_tokens=a.max_new_tokens, temperature=0.0)
    plain = [spec_jax.generate(target, p, **gen).token_ids for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            heads = spec_jax.load_draft(ROOT / "checkpoints" / f"smollm2-135m-instruct-{method}")
            out = spec_jax.export_heads(method, heads, Path(tmp) / method, target=target)
            files = ", ".join(sorted(f.name for f in out.iterdir()))
            back = spec_jax.import_heads(method, out, target)
            tree = a.tree or own_tree(heads)
            runs = {name: [spec_jax.generate(target, p, draft=h, tree=tree, fallback=False, **gen)
                           for p in prompts] for name, h in (("original", heads),
                                                             ("re-imported", back))}
            shown = tree if isinstance(tree, str) else f"static, {len(tree)} paths"
            print(f"\n{method}: exported {files}; tree {shown}")
            print("  prompt  tau original  tau re-imported  same tokens  = plain")
            for i in range(len(prompts)):
                o, r = runs["original"][i], runs["re-imported"][i]
                print(f"  {i:6d}  {o.stats['mean_accepted']:12.3f}  "
                      f"{r.stats['mean_accepted']:15.3f}  {str(o.token_ids == r.token_ids):>11}  "
                      f"{str(o.token_ids == plain[i] == r.token_ids):>7}")
            print(f"  all     {tau(runs['original']):12.3f}  {tau(runs['re-imported']):15.3f}  "
                  f"{str(all(x.token_ids == y.token_ids for x, y in zip(*runs.values()))):>11}")
            for name, rs in runs.items():
                print(f"  {name} tokens of prompt 0 ({len(rs[0].token_ids)}): {rs[0].token_ids}")


if __name__ == "__main__":
    main()
