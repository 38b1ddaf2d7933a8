"""Weights between processes: transport (`weight_transport.py`), the broadcast group (`weight_group.py`),
LoRA adapters (`lora.py`), the colocated engine reading the actor's tensors on one rank
(`shared_weights.py`).
"""
