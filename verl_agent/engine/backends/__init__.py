"""The engines that implement the `Engine` contract (`verl_agent.engine.contract`), one module each.

- `hf_engine`: `HFEngine`, the embedded transformers engine, over the continuous batcher and model
  runner of `verl_agent.engine` (continuous.py, scheduler.py, model_runner.py, kv_pool.py, ...);
- `sglang_engine`: `SGLangEngine`, a real SGLang server driven over its HTTP API;
- `scripted`: `ScriptedEngine`, scripted replies for tests, examples and overhead benchmarks.

A new engine is a module like these (in the package or your own) registered in `registry.ENGINES`
(docs/extending.md). Import the classes from `verl_agent.engine`; these modules load torch on import.
"""
