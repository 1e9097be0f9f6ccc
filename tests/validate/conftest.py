"""A demo payload built by hand (the shape :func:`flowlock.validate.demo.run_demo` returns), so the
report and the plot can be checked on chosen numbers without running a model."""

import pytest

STAGES = ("timestep_sinusoid", "timestep_mlp", "adaln_modulation", "norm1_modulate", "gate_residual", "norm_out")


def _path(mismatches_per_step: list[int], logp_per_step: list[int], dlogp_per_step: list[float], n: int) -> dict:
    steps = [{"step": k, "velocity_mismatches": v, "velocity_elements": 1000, "logp_mismatches": l,
              "max_abs_dlogp": d, "ratio_spread": d}
             for k, (v, l, d) in enumerate(zip(mismatches_per_step, logp_per_step, dlogp_per_step))]
    return {"n_samples": n, "transitions": len(steps), "rollout_batch": n, "seq_len": 24, "log_prob_flavour": "verl",
            "per_step": steps, "bitwise_equal": not any(mismatches_per_step) and not any(logp_per_step)}


def _chain(stock_invariant_at: str | None) -> dict:
    ours = [{"stage": s, "repeat_equal": True, "invariant": True, "chained_mismatches": 0, "local_mismatches": 0,
             "numel": 80} for s in STAGES]
    theirs = [{"stage": s, "repeat_equal": True, "invariant": s != stock_invariant_at} for s in STAGES]
    grads = [{"param": "w", "repeat_equal": True}]
    return {"batch": 3, "repeats": 3, "first_drifting_stage": None, "ok": True,
            "flowlock": {"stages": ours, "grads": grads, "x_grad_repeat_equal": True, "x_grad_invariant": True},
            "provider": {"stages": theirs, "grads": grads, "x_grad_repeat_equal": True, "x_grad_invariant": True}}


@pytest.fixture
def demo_payload():
    """``demo_payload(stock=[per-step velocity mismatches], ...)``: strict all zero, 3 steps, 4 samples,
    two replay batchings with the same numbers."""

    def build(stock=(0, 0, 0), stock_logp=(0, 0, 0), stock_dlogp=(0.0, 0.0, 0.0), gpu_evidence=None,
              trace_divergence=None, output_differs=False):
        runs = [{"replay_micro_batch": mb, "replay_order": order, "strict": _path([0, 0, 0], [0, 0, 0], [0.0] * 3, 4),
                 "provider": _path(list(stock), list(stock_logp), list(stock_dlogp), 4)}
                for mb, order in ((1, "reversed"), (3, "shuffled"))]
        trace = {"strict": {"records": 40, "divergence": None, "output_differs": False},
                 "provider": {"records": 72, "divergence": trace_divergence, "output_differs": output_differs}}
        return {"device": "cpu", "model": "tiny embedded H3 (random weights)", "backends": ["linear:reference"],
                "chain": _chain("timestep_mlp"), "trace": trace, "consistency": runs,
                "timing": {"n_samples": 4, "replay_micro_batch": 1, "rounds": 5, "warmup": 1,
                           "median_s": {"strict": 0.5, "provider": 0.1}, "ratio": 5.0},
                "gpu_evidence": gpu_evidence, "ok": True}

    return build
