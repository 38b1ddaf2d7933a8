"""What runs the hf engine's model on its device: the prefill and decode forwards over the slot KV pool
(`model_runner`, `kv_pool`), the engine's own decode step for Llama-family models (`decode_step`), fused
norms, the compile cache, LoRA adapters, and the fixed-address memory that lets CUDA graphs survive sleep
(`arena`)."""
