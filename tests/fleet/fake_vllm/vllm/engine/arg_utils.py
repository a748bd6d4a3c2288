"""EngineArgs with the fields the plugin reads; model configs from a small table."""

from dataclasses import dataclass
from types import SimpleNamespace

_DEEPSEEK = dict(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                 v_head_dim=128)
MODELS = {
    "deepseek-ai/DeepSeek-V3": SimpleNamespace(use_mla=True, dtype="torch.bfloat16",
                                               hf_text_config=SimpleNamespace(**_DEEPSEEK)),
    "deepseek-ai/DeepSeek-V3.2": SimpleNamespace(use_mla=True, dtype="torch.bfloat16",
                                                 hf_text_config=SimpleNamespace(**_DEEPSEEK, index_topk=2048)),
    "meta-llama/Llama-3.1-8B": SimpleNamespace(use_mla=False, dtype="torch.bfloat16",
                                               hf_text_config=SimpleNamespace(num_attention_heads=32)),
}


@dataclass
class EngineArgs:
    model: str = "deepseek-ai/DeepSeek-V3"
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    attention_backend: object = None
    attention_config: object = None

    def create_model_config(self):
        if self.model not in MODELS:
            raise ValueError(f"model {self.model} not found")
        return MODELS[self.model]

    def create_engine_config(self):
        self.create_model_config()
        return {"attention_backend": self.attention_backend, "model": self.model}
