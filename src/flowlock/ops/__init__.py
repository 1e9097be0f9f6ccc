"""flowlock's operators: each validated public function dispatches to Triton (CUDA) or its
PyTorch reference (CPU); see ``flowlock.dispatch``."""
