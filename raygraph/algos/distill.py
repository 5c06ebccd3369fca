"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens,
and the student learns to lower its reverse KL to the teacher on them.

For a sampled token `y_t ~ pi(. | x, y_<t)`, `log pi(y_t) - log q(y_t)` is an unbiased one-sample
estimate (k1) of `KL(pi || q)` at that position; its negative is the token's reward. Given to the
token as its advantage with no credit to the tokens before it (discount 0), the policy gradient
`E[A_t grad log pi(y_t)]` lowers each position's reverse KL: mode-seeking, so the student does not
spread mass over what the teacher would never say (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649; Gu et al. 2024,
"MiniLLM", arXiv:2306.08543).
"""

from __future__ import annotations

from torch import Tensor

from raygraph.algos.masked import masked_mean

__all__ = ["reverse_kl_advantages", "reverse_kl"]


def reverse_kl_advantages(logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor, *,
                          coef: float = 1.0) -> Tensor:
    """Per-token advantages `-coef * (log pi(y_t) - log q(y_t))` on response tokens, 0 on padding.

    Args:
        logprobs: `(B, R)` the student's log-probs of its sampled tokens (the rollout's).
        teacher_logprobs: `(B, R)` the teacher's log-probs of the same tokens.
        response_mask: `(B, R)` 1 on generated tokens.
        coef: scale of the advantage (the distillation loss weight).

    Returns:
        `(B, R)` float32 advantages.
    """
    return -coef * (logprobs.float() - teacher_logprobs.float()) * response_mask


def reverse_kl(logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor) -> float:
    """The batch's mean per-token reverse-KL estimate `mean_t(log pi(y_t) - log q(y_t))` (k1)."""
    return float(masked_mean(logprobs.float() - teacher_logprobs.float(), response_mask))
