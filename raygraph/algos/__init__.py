"""The mathematics of RL post-training as pure torch functions (no Ray, no config, no state).

    from raygraph.algos import advantages, losses, kl
    adv, ret = advantages.compute("grpo", token_rewards=..., response_mask=..., group_ids=...)
    loss, stats = losses.policy_loss("ppo", logprobs=..., old_logprobs=..., advantages=adv, ...)

Modules: `advantages` (estimators), `losses` (policy/value losses, aggregation, DPO),
`kl` (per-token KL estimators), `kl_control` (KL coefficient controllers), `entropy`,
`masked` (masked reductions), `dpo`, `distill` (on-policy distillation). See docs/algorithms.md for formulas and papers.
"""

from raygraph.algos import advantages, distill, dpo, entropy, kl, kl_control, losses, masked

__all__ = ["advantages", "distill", "dpo", "entropy", "kl", "kl_control", "losses", "masked"]
