"""The draft methods by name: each declared once in its own module (spec_jax.heads.method)."""
from __future__ import annotations

from spec_jax.errors import SpecJaxError
from spec_jax.heads import eagle, eagle3, medusa, mtp
from spec_jax.heads.method import Method

METHODS: dict[str, Method] = {m.name: m for m in (eagle.METHOD, eagle3.METHOD, medusa.METHOD,
                                                  mtp.METHOD)}


def method_of(name: str) -> Method:
    """The method called `name`; SpecJaxError naming it and the known ones if there is none."""
    method = METHODS.get(name)
    if method is None:
        raise SpecJaxError(f"unknown draft method {name!r}: choose one of {', '.join(METHODS)}")
    return method
