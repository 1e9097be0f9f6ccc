"""Issue 13 GPU evidence: vLLM-Omni's native H3 with flowlock installed, against vLLM-Omni stock and diffusers.

A random-weight diffusers ``MiniMaxH3Transformer3DModel`` at H3's full widths with 2 blocks and 1
refiner block (BF16, FP32 modules FP32) is loaded into vLLM-Omni's ``MiniMaxH3DiTModel`` by
vLLM-Omni's own ``load_weights``. Requests are laid out by vLLM-Omni's packer
(``minimax_h3_packed_sequence``, padded to a multiple of 64). Reported per request size:

* one forward (``no_grad``) of vLLM-Omni + flowlock (``install``) against vLLM-Omni stock (the same
  instance inside ``flowlock.mode("provider")``), same process, alternating order;
* engine invariance: the request alone and packed with a second request, vLLM-Omni + flowlock
  against diffusers + flowlock (``flowlock.patch``) on each request replayed alone
  (``flowlock.integrations.vllm_omni.minimax_h3.replay``): mismatching elements of video and audio velocities
  (0 expected), and the same counts for vLLM-Omni stock against diffusers stock, for contrast
  (packed only on a GPU);
* the attention backend vLLM-Omni resolved for each role.

Needs vllm 0.30.0 and vllm-omni 0.30.0 importable (``requirements/vllm-cpu.txt``; on a GPU the
platform's attention backend must load). Where vllm has no compiled ops (the pure-Python bundle of
``tools/vllm_omni_bundle.py``, as on the H200), the test suite's runtime (``tests/vllm_omni_env.py``)
is used on the GPU too: vLLM and vLLM-Omni on their unspecified platforms, attention through torch
SDPA. Stock then means vLLM-Omni's torch-native paths (RMSNorm, SiLU-and-mul, q/k norm + RoPE), cuBLAS
linears, torch SDPA attention (K/V cut to the request's rows) and vLLM-Omni's own Triton
indexed-modulation kernels; not vllm's CUDA ``_C`` kernels, its Triton fused q/k norm + RoPE (gated
on vLLM's CUDA platform) or FlashAttention. The JSON's ``vllm_runtime`` says which ran.
Run: ``python benchmarks/bench_vllm_omni.py --out
benchmarks/results/vllm_omni.json``; ``--smoke`` runs the tiny H3 on CPU with the test suite's CPU
shims to check the script end to end.
"""

from __future__ import annotations

import sys

import harness
import torch

import flowlock

GATE_TESTS = ("tests/integrations",)
# (text rows, latent t, latent h, latent w, audio frames): about 3.5k and 17k packed rows.
FULL_REQUESTS = ((256, 8, 32, 48, 100), (256, 21, 48, 64, 250))
SMOKE_REQUESTS = ((5, 2, 4, 6, 4),)
SECOND_REQUEST_SCALE = 2  # the packed partner: latent t halved, text and audio halved


def _test_runtime():
    sys.path.insert(0, str(harness.REPO / "tests"))
    import vllm_omni_env

    return vllm_omni_env


def make_request(shape: tuple[int, int, int, int, int], text_dim: int, seed: int, device: torch.device):
    """A MiniMaxH3DenoiseBranch for ``shape`` with seeded prompt embeddings and latent rows."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    text_len, lt, lh, lw, audio_t = shape
    packed = minimax_h3_packed_sequence(text_len=text_len, latent_t=lt, latent_h=lh, latent_w=lw, audio_t=audio_t,
                                        include_keyframe_cond=False)
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(text_len, text_dim, generator=gen).to(torch.bfloat16)
    video = torch.randn(packed["img_pos"].numel(), 96, generator=gen).to(device)
    audio = torch.randn(packed["audio_pos"].numel(), 32, generator=gen).to(device)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=text.to(device),
                                    token_tags=packed["token_tags"], device=device)
    return branch, video, audio


def native_kwargs(requests) -> dict:
    from vllm_omni.diffusion.models.minimax_h3.batched_packing import minimax_h3_batched_forward_kwargs

    n = len(requests)
    return minimax_h3_batched_forward_kwargs(
        branches=[b for b, _, _ in requests], video_rows=[v for _, v, _ in requests],
        audio_rows=[a for _, _, a in requests], t_video=[0.3, 0.7][:n], t_audio=[0.55, 0.2][:n],
        imgvid_cond_timesteps=[0.999] * n, audio_ref_cond_timesteps=[1.0] * n)


def mismatches(native, diffusers, kwargs: dict, mode: str) -> list[dict]:
    """Per request: elements of (video, audio) where the packed native forward and diffusers differ."""
    from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests
    from flowlock.testing import mismatch_count

    with torch.no_grad(), flowlock.mode(mode):
        video, audio = native(**kwargs)
        rows = []
        for replay in diffusers_requests(kwargs):
            out = diffusers(**replay.kwargs)
            ref_v = out.sample[0] * replay.update_mask.unsqueeze(-1)
            rows.append({"video": mismatch_count(video[replay.video_rows], ref_v), "video_elements": ref_v.numel(),
                         "audio": mismatch_count(audio[replay.audio_rows], out.audio_sample[0]),
                         "audio_elements": out.audio_sample[0].numel()})
    return rows


def _extra(parser) -> None:
    parser.add_argument("--layers", type=int, default=2, help="DiT blocks at full width")


def main(argv=None) -> int:
    from flowlock.integrations.vllm_omni import install
    from flowlock.integrations.vllm_omni.runtime import build_native
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3

    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    device = torch.device(args.device)
    gate = harness.gate_or_exit(args, list(GATE_TESTS))
    torch.backends.cuda.matmul.allow_tf32 = False
    env = _test_runtime()
    # before vllm is imported: a vllm without compiled ops resolves the platforms a CPU host gets
    pure_python = env.pin_pure_python_platforms()
    if args.smoke or pure_python:
        env.ensure_runtime()  # the test shims: SDPA attention, a one-rank gloo group
        env.check_pure_python_platforms()
    runtime = ("pure-Python vllm (no compiled ops): unspecified vLLM / vLLM-Omni platforms and the test shims "
               "(tests/vllm_omni_env.py); stock = vLLM-Omni's torch-native paths, cuBLAS linears, torch SDPA, "
               "vLLM-Omni's Triton indexed modulation" if pure_python else
               "CPU test shims (tests/vllm_omni_env.py)" if args.smoke else "vllm with its compiled ops")
    if args.smoke:
        config = {**TINY_H3_CONFIG, "in_channels": 24, "audio_in_channels": 32}
    else:
        config = full_width_config(num_layers=args.layers, num_refiner_layers=1)
    shapes = SMOKE_REQUESTS if args.smoke else FULL_REQUESTS
    diffusers = make_h3(config, seed=0, dtype=torch.bfloat16, device=device, draw_on_device=not args.smoke)
    if args.smoke:
        from vllm_omni_env import build_native as build_cpu

        native = build_cpu(config, diffusers.state_dict(), adaln_cache=False)
    else:
        # the AdaLN memo cache off: every timed call repeats one timestep, which a rollout step does not
        native = build_native(config, diffusers.state_dict(), device, adaln_cache=False)
    backends = sorted({f"{m.role}: {m.attn_backend.get_name()}" for m in native.modules()
                       if type(m).__name__ == "Attention" and getattr(m, "attn_backend", None) is not None})
    from flowlock.validate.engines import _stock_packs

    stock_packs = _stock_packs(native)  # vLLM-Omni's own rule: its attention isolates packed requests
    rows = []
    with flowlock.patch(diffusers), install(native):
        for i, shape in enumerate(shapes):
            request = make_request(shape, config["text_dim"], seed=i, device=device)
            text_len, lt, lh, lw, audio_t = shape
            partner_shape = (text_len // 2, max(1, lt // SECOND_REQUEST_SCALE), lh, lw, max(1, audio_t // 2))
            partner = make_request(partner_shape, config["text_dim"], seed=100 + i, device=device)
            alone, packed = native_kwargs([request]), native_kwargs([request, partner])

            def forward(mode, kwargs=alone):
                with torch.no_grad(), flowlock.mode(mode):
                    native(**kwargs)

            timing = harness.time_pair(lambda _: forward("strict"), lambda _: forward("provider"), device=device,
                                       iters=args.iters, warmup=args.warmup)
            row = {"request": dict(zip(("text", "latent_t", "latent_h", "latent_w", "audio_t"), shape)),
                   "S": request[0].seq_len, "used": request[0].used_len,
                   "forward": {"flowlock": timing["a"], "stock": timing["b"],
                               "flowlock_over_stock": timing["ratio_a_over_b"]},
                   "mismatches": {"flowlock_alone": mismatches(native, diffusers, alone, "strict"),
                                  "flowlock_packed": mismatches(native, diffusers, packed, "strict"),
                                  "stock_alone": mismatches(native, diffusers, alone, "provider")}}
            if stock_packs:
                # vLLM-Omni's SDPA attention refuses packed requests; its GPU varlen backends take them
                row["mismatches"]["stock_packed"] = mismatches(native, diffusers, packed, "provider")
            rows.append(row)
            print(f"S={row['S']}: flowlock/stock {timing['ratio_a_over_b']:.3f}; mismatches {row['mismatches']}",
                  flush=True)
    payload = {"benchmark": "vllm_omni", "smoke": args.smoke, "config": config, "gate": gate,
               "environment": {**harness.environment(device), "vllm": harness._version("vllm"),
                               "vllm_omni": harness._version("vllm_omni")},
               "attention_backends": backends, "vllm_runtime": runtime, "stock_packs_requests": stock_packs,
               "method": "same vLLM-Omni model instance, install()ed strict vs provider mode, same process, "
                         "alternating order, median/p20/p80 of >= 20 timed forwards after warm-up; "
                         "AdaLN memo cache off",
               "results": rows}
    path = harness.write_json(args.out, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
