"""Weights between processes: transport (`weight_transport.py`), the broadcast group (`weight_group.py`),
LoRA adapters (`lora.py`).
"""
