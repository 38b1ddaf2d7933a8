"""Tool-call and reasoning formats of model families, one module per kind of syntax.

`verl_agent.parsers` registers them by name (the one list of names) and is what the rest of the package
imports; the modules here import only `protocol`:

- base.py: `ParseResult` and the helpers every parser shares
- reasoning.py: ``<think>`` blocks; harmony.py: gpt-oss's channels (analysis = reasoning)
- xml_calls.py: Qwen3-Coder, GLM-4.5 (string arguments, typed by typed_args.py from the tool's schema)
- special_tokens.py: DeepSeek V3.1+, Kimi K2; pythonic.py: Llama 4
- detect.py: the format a chat template speaks
"""
