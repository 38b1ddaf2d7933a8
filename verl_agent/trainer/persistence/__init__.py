"""What a run leaves on disk to resume from: checkpoints (`checkpoint.py`) and state files (`state_files.py`).
"""
