"""The first draft step of any heads over a teacher-forced sequence (`draft_logits`): what the
heads would propose at each position given the true tokens so far, for checking imported heads
against their reference implementation and measuring a head's next-next-token accuracy."""
from __future__ import annotations

import numpy as np

from spec_jax.errors import SpecJaxError


def draft_logits(target, heads, token_ids) -> np.ndarray:
    """float32 [n-1, vocab]: row j is the heads' first draft step for token_ids[j+2], made from the
    target's features of token_ids[0..j] and the tokens token_ids[1..j+1] (EAGLE's training
    alignment; Medusa's head 0 and the first MTP module alike; the last row predicts the token
    after the sequence). Entries outside a draft vocabulary are -inf."""
    import jax
    import jax.numpy as jnp

    from spec_jax.features import _target_features
    from spec_jax.heads.methods import method_of
    from spec_jax.heads.registry import DraftHeads

    if not isinstance(heads, DraftHeads):
        raise SpecJaxError("draft_logits takes draft heads (spec_jax.load_draft, import_heads or "
                           f"init_draft), not {type(heads).__name__}")
    ids = np.asarray(token_ids).reshape(-1)
    if ids.size < 2:
        raise SpecJaxError("draft_logits needs at least 2 tokens")
    v = target.cfg.vocab_size
    if ids.min() < 0 or ids.max() >= v:
        raise SpecJaxError(f"token ids must lie in [0, {v})")
    heads.check_target(target)
    method = method_of(heads.method)
    drafter = heads.drafter()
    dparams = heads.bind(target, pack=False)
    toks = jnp.asarray(ids[None].astype(np.int32))
    key = ("draft_logits", drafter, heads.method)
    run = target.compiled.get(key)
    if run is None:  # one program per drafter (and sequence length), kept with the target
        def first_step(dparams, tparams, toks):
            hidden, aux = _target_features(tparams, toks, target=target,
                                           aux_layers=tuple(drafter.aux_layers), chunk=None)
            return method.profile_logits(drafter, dparams, tparams, target.cfg, toks, hidden, aux,
                                         1)[0]

        run = target.compiled[key] = jax.jit(first_step)
    lg = np.asarray(run(dparams, target.params, toks)[0, : ids.size - 1], np.float32)
    if "d2t" not in dparams:
        return lg
    full = np.full((lg.shape[0], v), -np.inf, np.float32)
    full[:, np.asarray(dparams["d2t"])] = lg
    return full
