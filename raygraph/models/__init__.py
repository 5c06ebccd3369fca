"""Model loading, log-probs, value heads and the tiny-model factory (no Ray)."""
