"""Backends execute the fine-grained resize operations on real engines; installed as
`dynaresized.backends`. `sim` drives simulated workers for the demo, `torch` trainer ranks
(torch.distributed), `vllm` rollout engines (vLLM)."""
