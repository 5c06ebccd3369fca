"""The driver, read top to bottom (`trainer.run` is the loop).

    trainer.py      the loop: graph and roles built once, then one graph run per step
    setup.py        run directory, local assets (tiny model, toy data), the Ray connection
    role_specs.py   config -> resource pools and role specs (flat worker arguments)
    feed.py         the prompts fed to each step; merging the step's metric outputs
    validation.py   the validation graph (greedy decoding, scored)
    warm_start.py   optional SFT steps before RL
    checkpoint.py   atomic checkpoint directories, resume resolution
    tracking.py     metrics.jsonl, MLflow, console progress
"""
