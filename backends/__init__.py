"""Backends: execute the fine-grained resize operations on real engines.

Installed as `dynaresized.backends`; each backend is a subpackage (e.g. `dynaresized.backends.vllm`).
"""
