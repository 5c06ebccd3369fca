"""The driver, read top to bottom (`trainer.run` is the loop).

    trainer.py         the loop: graphs and roles built once, then one graph run per step
    setup.py           run directory, local assets (tiny model, toy data), the Ray connection
    graphs.py          the worker class of each role, the step and validation graphs (checked)
    role_specs.py      config -> placement plan, resource pools and role specs (flat worker arguments)
    feed.py            the prompts fed to each step; merging the step's metric outputs
    validation.py      the validation graph run (greedy and sampled), samples kept and shown
    warm_start.py      optional SFT steps before RL
    checkpoint.py      atomic checkpoint directories, resume resolution
    resume.py          what a checkpoint holds of the run and how a run continues from one
    ledger.py          which prompts each step trained (nothing lost or trained twice)
    samples.py         generations written per step and validation
    tracking.py        metrics.jsonl, MLflow, console progress, Ray metrics
    health.py          updates that did nothing, non-finite values
    data_checks.py     every data problem at once, before Ray starts
    recovery.py        run-level recovery after a failed attempt
    stage_recovery.py  a dead stateless actor restarted alone, its step rerun
    stopping.py        SIGTERM/SIGINT to a checkpoint at the next step boundary
"""
