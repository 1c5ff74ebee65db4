"""Draft-head training: self-distillation data, losses per method, the optax loop, checkpoints."""
