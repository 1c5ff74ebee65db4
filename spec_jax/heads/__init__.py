"""Draft heads: one file per method, one interface (`spec_jax.heads.base.Drafter`)."""
from spec_jax.heads.base import Drafter

__all__ = ["Drafter"]
