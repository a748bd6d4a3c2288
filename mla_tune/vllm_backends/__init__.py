"""mla-tune's Triton MLA kernels as vLLM 0.33 attention backends (MLA_TUNE_TRITON, MLA_TUNE_TRITON_SPARSE).

Importing this package imports neither torch nor vLLM: `capabilities` is data.
`dense` and `sparse` subclass vLLM's own classes and are imported by vLLM
through the class paths that `mla_tune.vllm_plugin.register` registers.
"""

from mla_tune.vllm_backends.capabilities import BACKENDS, DENSE, SPARSE, refusal_reasons

__all__ = ["BACKENDS", "DENSE", "SPARSE", "refusal_reasons"]
