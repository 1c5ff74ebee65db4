"""Hardware-aware tree sizing (`tree="auto"`): the draft tree that maximises tokens/s here.

Sequoia's idea with measured costs, in three measurements:

1. Acceptance profile. The target writes greedy continuations of calibration prompts; the draft
   heads then run along these true paths (teacher-forced, which is what they see at inference for
   every node on the accepted path) and record, at each depth d, the rank of the true token among
   their candidates. Under greedy verification a static tree accepts its node (r1, ..., rd) exactly
   when the true ranks at depths 1..d are r1..rd. The best tree with n nodes is the root plus
   the n - 1 most frequent rank prefixes (a prefix is never rarer than its extensions, so they
   form a tree), and its tau is found by replaying greedy decoding over the profile: from each
   step's root, accept the longest prefix in the tree, move past the accepted tokens and the
   bonus token. (The mean over all positions would overrate it: decoding visits more of the
   positions that follow a rejection.)
2. Costs. The target's forward latency over T tree tokens (verification) and the drafter's
   per-step latency (propose + bookkeeping) at each depth, on this backend and batch size.
3. Choice. Predicted tokens/s of the best tree of each size = tau / (verify + draft) per step.
   The best prediction and plain decoding (and, where predicted to beat plain, the dynamic tree
   of the same top-k, depth and size; and, among the predictions within 3% of the best, the one
   with the highest tau and the smallest tree, see `contenders`) are then run end to end on the
   calibration prompts, and the fastest wins: speculation is chosen only where it measurably
   pays (a datastore graft must win by more than the host's noise, see `pick_winner`). The best
   speculative candidate also runs with the plain-step fallback (`spec_jax.fallback`) at
   its measured break-even, and keeps it where that run measured as fast (`choose`): a tree
   that loses to plain decoding on average may win with it, on the requests it suits.
   Beside fixed trees, switches (spec_jax.compose.switch) of 4, 8, 12 and 16 tokens are weighed:
   per step the tokens go to the head's tree or to an n-gram chain by the length of the context's
   n-gram match, with the policy that accepts most on the profile (`switch_trees`), each step
   charged the draft depth of the arm it chooses (`switch_draft_seconds`); the best predicted
   switch runs end to end too. Each switch also records the tau of the best arm at every step
   (`tau_ceiling`): how much any policy over those arms could add.

Sampling (temperature > 0). Verification tries a node's children in order and accepts child c with
the target's probability of its token (see spec_jax.verify): the same outcome as drawing a token
from the target and accepting the child that holds it. So the profile taken along *sampled*
continuations of the calibration prompts is a draw of the sampled acceptance, and everything
above carries over; the end-to-end runs sample too. Each (temperature, top_p) is sized and cached
on its own: at temperature 0.7 the shipped EAGLE head's 32-token dynamic tree accepts 2.22
tokens per call on MT-bench against 2.31 greedy (2.08 against 2.35 on HumanEval), and the sizing
chose shallower head arms than for greedy decoding.

The choice is cached per device kind, target (and its layer layout: packed CPU matmuls change every
cost), heads (method + weights fingerprint) and batch bucket (`batch_bucket`: the next power of two
of a call's rows; a bigger batch makes verification costlier, and there the sizing may choose a
smaller tree or plain decoding). The verify-latency curve is cached per device kind, target and
batch bucket, shared by every drafter's calibration, and each new calibration
keeps the fastest reading per size (`shared_verify_latency`).

The package, arrows pointing down: `names` (PLAIN and the names of choices), `choice` (deciding
from measurements), `cache` (the file, its keys and the cached lookups), `profile` (acceptance
profiles and their replay), `latency` (measured costs), `search` (the trees and switches a profile
supports), `calibrate` (`size_tree`, `size_ngram`: the runs that tie them together, and
`resolve`: what a tree left to the sizing stands for). Everything other modules use is
re-exported here; to patch a name for a test, patch it in the module that looks it up
(`calibrate` for the costs and end-to-end runs, `search` for SWITCH_MIN_POSITIONS).
"""
from spec_jax.sizing.cache import (
                                   _cache,
                                   _store,
                                   batch_bucket,
                                   cache_file,
                                   cached_choice,
                                   cached_ngram,
                                   cached_tree,
                                   calibration_key,
                                   ngram_key,
                                   shared_verify_latency,
                                   verify_key,
)
from spec_jax.sizing.calibrate import (
                                   CALIBRATION_TOKENS,
                                   DEFAULT_PROMPTS,
                                   DS_DEPTHS,
                                   GRAFT_DEPTHS,
                                   NGRAM_CHAINS,
                                   SWITCH_SIZES,
                                   _measure,
                                   resolve,
                                   size_ngram,
                                   size_tree,
)
from spec_jax.sizing.choice import (
                                   DS_MARGIN,
                                   FALLBACK_ACTED,
                                   FALLBACK_TIE_SHARE,
                                   PROBE_MARGIN,
                                   break_even,
                                   choice_of,
                                   choose,
                                   chosen_fallback,
                                   fallback_point,
                                   pick_winner,
                                   sized_choice,
)
from spec_jax.sizing.latency import _best_time, draft_latency, verify_latency
from spec_jax.sizing.names import PLAIN, choice_name, measured_name, tree_name, tree_tokens
from spec_jax.sizing.profile import (
                                   _replay,
                                   chain_profile,
                                   match_profile,
                                   profile_depth,
                                   rank_profile,
                                   replay_tau,
)
from spec_jax.sizing.search import (
                                   SWITCH_MIN_POSITIONS,
                                   TREE_SIZES,
                                   best_trees,
                                   contenders,
                                   switch_draft_seconds,
                                   switch_trees,
)

__all__ = ["CALIBRATION_TOKENS", "DEFAULT_PROMPTS", "DS_DEPTHS", "DS_MARGIN", "FALLBACK_ACTED",
           "FALLBACK_TIE_SHARE", "GRAFT_DEPTHS", "NGRAM_CHAINS", "PLAIN", "PROBE_MARGIN",
           "SWITCH_MIN_POSITIONS", "SWITCH_SIZES", "TREE_SIZES", "_best_time", "_cache", "_measure",
           "_replay", "_store", "batch_bucket", "best_trees", "break_even", "cache_file", "cached_choice",
           "cached_ngram", "cached_tree", "calibration_key", "chain_profile", "choice_name",
           "choice_of", "choose", "chosen_fallback", "contenders", "draft_latency",
           "fallback_point", "match_profile", "measured_name", "ngram_key", "pick_winner",
           "profile_depth", "rank_profile", "replay_tau", "resolve", "shared_verify_latency",
           "size_ngram", "size_tree", "sized_choice", "switch_draft_seconds", "switch_trees",
           "tree_name", "tree_tokens", "verify_key", "verify_latency"]
