"""What every strict model path reuses, whichever family and engine: the run context a root forward
hands to the submodules it calls, the mode-aware patched forward, and the diffusers hook and peft
LoRA handling of a diffusers model. Imports no family."""
