"""XLA CPU settings, applied once before JAX starts its backend.

Side effect of `import spec_jax`: `spec_jax/__init__.py` calls `apply_defaults()`, which appends
`--xla_cpu_use_xnnpack=true` to the environment variable XLA_FLAGS (the process's own environment,
so child processes inherit it). XLA reads XLA_FLAGS when its backend starts, so the flag only
counts if spec_jax is imported before the first JAX computation.

Why: XLA's CPU matmuls through XNNPACK run the small-batch matrix-vector products of decoding
about 1.4x faster here (measured: SmolLM2-135M plain decode 23 -> 32 tokens/s on 2 cores); the
test suite's run time counts on it too.

Opting out: set SPEC_JAX_DEFAULT_XLA_FLAGS=0 (XLA_FLAGS is then not touched), or put your own
`--xla_cpu_use_xnnpack=...` into XLA_FLAGS (a value already there is left alone; other flags in
XLA_FLAGS are kept and the default is appended after them).
"""
import os


def apply_defaults() -> None:
    if os.environ.get("SPEC_JAX_DEFAULT_XLA_FLAGS", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_use_xnnpack" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_use_xnnpack=true").strip()


def enable_compilation_cache(path=None):
    """Keep compiled programs on disk (JAX's persistent compilation cache), so that the next
    process loads them instead of compiling again: a later `spec-jax generate` of SmolLM2 starts
    decoding in 1.7 s instead of 5.8. The CLI turns it on; call it yourself in a notebook or
    service. Leaves a cache directory already configured alone; SPEC_JAX_XLA_CACHE=0 turns it
    off. The default folder, $SPEC_JAX_CACHE/xla/ (~/.cache/spec_jax), is named by backend and,
    on CPU, by the spec_jax kernels' build (their source and the CPU they were compiled for).
    Returns the folder in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if os.environ.get("SPEC_JAX_XLA_CACHE", "1") == "0":
        return None
    if path is None:
        from pallas_kernels.cpu.build import build_id
        from spec_jax.paths import cache_dir

        backend = jax.default_backend()
        build = build_id() if backend == "cpu" else ""
        path = cache_dir() / "xla" / (f"{backend}-{build}" if build else backend)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size < 0:
        jax.config.update("jax_compilation_cache_max_size", 2 << 30)  # least recently used go
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
        # a generation compiles many sub-second programs (prefill buckets, sampling, the cache's
        # set-up) that add up: an EAGLE `generate` started in 7.4 s instead of 9.2 with them kept
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return str(path)
