"""raygraph: Ray-native RL post-training for LLMs.

User code (a plugin named in a config's `plugins:` list, imported in every process of the run)
registers its own pieces by name, then a config refers to that name:

    import raygraph

    @raygraph.register_policy_loss("my_loss")      # actor.policy_loss: my_loss
    def my_loss(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg): ...

`register_advantage` (algorithm.advantage), `register_reward` (reward.function),
`register_kl_estimator` (actor.kl_loss_kind, algorithm.kl_in_reward.kind) and `register_dpo_loss`
(algorithm.dpo_loss) work alike;
see docs/custom-algorithm.md.
"""

import raygraph.models.lean_imports as _lean_imports
import raygraph.models.transformers_index as _transformers_index

__version__ = "0.1.0"
__all__ = ["register_policy_loss", "register_advantage", "register_reward", "register_kl_estimator",
           "register_dpo_loss"]

# name -> (module, attribute); imported on first use, so `import raygraph.config` stays as light as before
_PUBLIC = {
    "register_policy_loss": ("raygraph.algos.losses", "register_policy_loss"),
    "register_advantage": ("raygraph.algos.advantages", "register_advantage"),
    "register_reward": ("raygraph.rewards", "register_reward"),
    "register_kl_estimator": ("raygraph.algos.kl", "register_kl_estimator"),
    "register_dpo_loss": ("raygraph.algos.dpo", "register_dpo_loss"),
}


_transformers_index.use_stored_index()   # ~0.5 CPU-s less in every process that imports transformers
_lean_imports.skip_unused_imports()   # SciPy and (CPU-only torch) Triton put off: ~0.45 CPU-s less a model process


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'raygraph' has no attribute {name!r}")
    import importlib

    module, attr = _PUBLIC[name]
    return getattr(importlib.import_module(module), attr)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
