"""The OpenAI Chat Completions API, both sides.

Serving it (an agent you already have talks to our engine):
- `openai_server`: the OpenAI-compatible endpoint over any `Engine`;
- `openai_wire`: its wire format (request validation, response and SSE bodies), pure functions;
- `recorder`: token-exact recording of each session's calls, so they train like native rollouts;
- `agent_function`: `AgentFunctionLoop`, which runs the user's ``run_agent`` against that endpoint.

Calling it (our tool loop against a model served elsewhere):
- `chat_api`: `ChatAPILoop`, for evaluating a vLLM, SGLang or hosted model.
"""
