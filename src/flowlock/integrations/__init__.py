"""Engine integrations. Each subpackage imports its engine only when one of its functions is
called, so ``import flowlock`` never imports an engine (``flowlock.integrations.vllm_omni``:
vLLM-Omni's native MiniMax-H3)."""
