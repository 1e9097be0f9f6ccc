"""Stand-ins for a compiled Triton kernel and its CUDA launcher, for host-path tests without a GPU."""

from triton.backends.nvidia.driver import CudaLauncher


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def cuda_launcher(global_scratch=0, profile_scratch=0, cooperative=False, pdl=True):
    """A CudaLauncher with its metadata set and its C ``launch`` replaced by a recorder."""
    launcher = CudaLauncher.__new__(CudaLauncher)
    launcher.num_ctas = 1
    launcher.global_scratch_size, launcher.global_scratch_align = global_scratch, 8
    launcher.profile_scratch_size, launcher.profile_scratch_align = profile_scratch, 8
    launcher.launch_cooperative_grid, launcher.launch_pdl = cooperative, pdl
    launcher.launch = Recorder()
    return launcher


class Compiled:
    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, 0xF00, (4, 1, 0)
