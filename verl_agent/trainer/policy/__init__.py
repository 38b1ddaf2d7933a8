"""A train rank's model and passes: the actor/ref/critic (`policy.py`), log-probs and updates (`actor.py`),
FSDP2 loading (`fsdp.py`), the memory plan (`memory.py`), training sequences (`batch.py`), a step's kept
trajectories and their advantages (`step_batch.py`, `prepare.py`).
"""
