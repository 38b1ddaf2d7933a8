"""Step metrics: metrics.jsonl, TensorBoard and the console (`tracker.py`), W&B and MLflow (`loggers.py`),
the torch profiler (`profiling.py`).
"""
