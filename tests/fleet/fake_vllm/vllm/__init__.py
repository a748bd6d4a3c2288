"""A minimal stand-in for vLLM that follows its general-plugin contract (tests only).

What it reproduces: `vllm.plugins.load_general_plugins()` loads every entry
point of the group `vllm.general_plugins` once per process, honouring the
`VLLM_PLUGINS` allow-list, and calls each with no arguments before any work;
`EngineArgs.create_engine_config()` turns the user's arguments (with
`attention_backend` None unless chosen) into the engine config; and
`AttentionBackendEnum` names the attention backends.
"""
