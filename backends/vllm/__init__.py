"""The vLLM rollout backend: real vLLM engines that leave and rejoin the rollout pool.

`RolloutEngine` wraps one `AsyncLLM`; `RequestRouter` places a step's samples over the
engines in the pool and hands requests over when one drains or dies; `StepLedger` proves
every sample of a step was produced exactly once; `WeightStore` is where the trainer
publishes policy versions; `EngineWorker` attaches one engine to the daemon and executes
the rollout side of a resize. vLLM is imported only where an engine is started, so the
pure parts (ledger, weight store) import without the `vllm` extra.
"""
