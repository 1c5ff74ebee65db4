"""How sizing choices are counted and named: PLAIN (plain decoding's verdict), the tree tokens a
choice verifies per step, and the short names the sizing's reports and the bench print."""
from __future__ import annotations

PLAIN = "plain"


def tree_tokens(tree) -> int:
    """Tree tokens (nodes incl. the root) of a sizing choice."""
    if tree == PLAIN:
        return 1
    if isinstance(tree, dict) and "switch" in tree:
        arm = tree["switch"][0]
        return len(arm["base"]) + 1 + int(arm["ngram"])
    if isinstance(tree, dict) and "ngram" in tree:
        return tree_tokens(tree["base"]) + int(tree["ngram"]) + int(tree.get("ds", 0))
    return tree["total_tokens"] if isinstance(tree, dict) else len(tree) + 1


def measured_name(m: dict) -> str:
    """`choice_name` of a measured candidate (with the fallback it ran with, if any)."""
    return choice_name(m["tree"], m.get("fallback"))


def choice_name(tree, fallback=None) -> str:
    """`tree_name`, with "+plain<B" for a plain-step fallback below the break-even B."""
    return tree_name(tree) + (f"+plain<{fallback[0]:.2f}" if fallback else "")


def tree_name(tree) -> str:
    """Short name of a sizing choice: plain, dynamic:K,D,N or 'static N nodes', +ngram:G, or
    'switch N (ARM / ARM ...)' (each arm a head tree of its nodes and depth, +ngram:G)."""
    if tree == PLAIN:
        return "plain"
    if isinstance(tree, dict) and "switch" in tree:
        arms = " / ".join((f"head {len(a['base']) + 1} d{max(len(p) for p in a['base'])}"
                           if a["base"] else "root")
                          + (f"+ngram:{a['ngram']}" if a["ngram"] else "") for a in tree["switch"])
        return f"switch {tree_tokens(tree)} ({arms})"
    if isinstance(tree, dict) and "ngram" in tree:
        return (tree_name(tree["base"]) + (f"+ngram:{tree['ngram']}" if tree["ngram"] else "")
                + (f"+ds:{tree['ds']}" if tree.get("ds") else ""))
    if isinstance(tree, dict):
        return "dynamic:{top_k},{depth},{total_tokens}".format(**tree)
    if [list(p) for p in tree] == [[0] * d for d in range(1, len(tree) + 1)]:
        return f"chain:{len(tree)}"
    return f"static {len(tree) + 1} nodes, depth {max(len(p) for p in tree)}"
