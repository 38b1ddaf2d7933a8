"""Ray workers and their placement: a train rank (`worker.py`), a rollout worker (`rollout_worker.py`), the
controller that places them and gives the loop typed calls (`controller.py`), sharding lists (`sharding.py`).
"""
