"""Drafters built from other drafters: chains grafted onto a tree (`graft`), and a per-row switch
between arms of equal size (`switch`). They wrap any drafter of `spec_jax.heads` and know nothing
of how a tree option is written (spec_jax.tree_spec) or chosen (spec_jax.sizing)."""
